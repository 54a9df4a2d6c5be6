// cuda_cpu: stackful fibers, one per CUDA thread of the block being run.
//
// Two ways to switch between fibers:
// - x86-64 (the default there): a 22-instruction switch that saves the callee-saved
//   registers, MXCSR and the x87 control word (cgcpu_fiber_switch below, ~5 ns).
// - anywhere else, or with -DCG_CPU_UCONTEXT: POSIX ucontext (getcontext once per fiber
//   slot, makecontext per block, swapcontext per switch). glibc's swapcontext also saves the
//   signal mask with a system call (~300 ns a switch), and ASan warns once that it does not
//   fully support swapcontext; both paths tell ASan about every switch.
// Stacks: one mmap'd region per worker thread, a PROT_NONE guard page below each stack.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define CGCPU_ASAN 1
#else
#define CGCPU_ASAN 0
#endif

// ThreadSanitizer (the racecheck build, -fsanitize=thread): every CUDA thread is a TSan fiber
// and every switch tells TSan, without synchronising (__tsan_switch_to_fiber_no_sync): the
// happens-before edges between CUDA threads are the ones scheduler.h and warp.h declare for
// barriers, __syncwarp, block start and block end (README.md, "Racecheck").
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define CGCPU_TSAN 1
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#else
#define CGCPU_TSAN 0
#endif
// Not instrumented by TSan: the functions a fiber never returns from (its entry, its exit, a
// switch away for good, a fault), which must not push frames on the shadow stack of a fiber
// the next block reuses; the annotations themselves; the emulator's own hot loops.
#define CGCPU_NO_TSAN __attribute__((no_sanitize_thread))

#if defined(__x86_64__) && !defined(CG_CPU_UCONTEXT)
#define CGCPU_ASM_SWITCH 1
#else
#define CGCPU_ASM_SWITCH 0
#include <ucontext.h>
#endif

#if CGCPU_ASM_SWITCH
// void cgcpu_fiber_switch(void** save_sp, void* new_sp): saves this context's registers on its
// stack, stores the stack pointer in *save_sp, and resumes the context whose stack pointer is
// new_sp. A new fiber's stack is laid out as if it had called this function, returning into
// cgcpu_fiber_start, which calls entry(arg) (kept in r13 and r12). Weak, hidden and in a COMDAT
// group, so any number of translation units may include this header.
extern "C" void cgcpu_fiber_switch(void** save_sp, void* new_sp) __attribute__((visibility("hidden")));
extern "C" void cgcpu_fiber_start() __attribute__((visibility("hidden")));
__asm__(
    ".pushsection .text.cgcpu_fiber_switch,\"axG\",@progbits,cgcpu_fiber_switch,comdat\n"
    ".weak cgcpu_fiber_switch\n"
    ".hidden cgcpu_fiber_switch\n"
    ".type cgcpu_fiber_switch,@function\n"
    ".p2align 4\n"
    "cgcpu_fiber_switch:\n"
    "  .cfi_startproc\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    "  .cfi_endproc\n"
    ".size cgcpu_fiber_switch, .-cgcpu_fiber_switch\n"
    ".popsection\n"
    ".pushsection .text.cgcpu_fiber_start,\"axG\",@progbits,cgcpu_fiber_start,comdat\n"
    ".weak cgcpu_fiber_start\n"
    ".hidden cgcpu_fiber_start\n"
    ".type cgcpu_fiber_start,@function\n"
    ".p2align 4\n"
    "cgcpu_fiber_start:\n"
    "  .cfi_startproc\n"
    "  .cfi_undefined rip\n"  // the outermost frame of a fiber: unwinders stop here
    "  movq %r12, %rdi\n"
    "  callq *%r13\n"
    "  ud2\n"
    "  .cfi_endproc\n"
    ".size cgcpu_fiber_start, .-cgcpu_fiber_start\n"
    ".popsection\n");
#endif

namespace cgcpu {
namespace detail {

[[noreturn]] inline void die(const char* what) {
  std::fprintf(stderr, "cuda_cpu: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

struct Context {
#if CGCPU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
  bool made = false;
#endif
  void* tsan = nullptr;  // the TSan fiber (or the OS thread's own context) that runs it
};

// ---- ThreadSanitizer annotations (no-ops in other builds) ------------------------------------
// The emulator's own bookkeeping (the scheduler's queues, the warp's posts, threadIdx, the
// fibers' states) is written by whichever CUDA thread happens to run the scheduler: those
// writes are hidden from TSan (ignored), so that only the kernel's own accesses are checked.
CGCPU_NO_TSAN inline void tsan_ignore_begin() {
#if CGCPU_TSAN
  __tsan_ignore_thread_begin();
#endif
}
CGCPU_NO_TSAN inline void tsan_ignore_end() {
#if CGCPU_TSAN
  __tsan_ignore_thread_end();
#endif
}
CGCPU_NO_TSAN inline void tsan_release(void* object) {
#if CGCPU_TSAN
  __tsan_release(object);
#else
  (void)object;
#endif
}
CGCPU_NO_TSAN inline void tsan_acquire(void* object) {
#if CGCPU_TSAN
  __tsan_acquire(object);
#else
  (void)object;
#endif
}
struct TsanIgnore {  // the emulator's bookkeeping in a scope
  TsanIgnore() { tsan_ignore_begin(); }
  ~TsanIgnore() { tsan_ignore_end(); }
  TsanIgnore(const TsanIgnore&) = delete;
  TsanIgnore& operator=(const TsanIgnore&) = delete;
};
CGCPU_NO_TSAN inline void tsan_switch(const Context& to) {
#if CGCPU_TSAN
  if (to.tsan != nullptr) __tsan_switch_to_fiber(to.tsan, __tsan_switch_to_fiber_no_sync);
#else
  (void)to;
#endif
}

typedef void (*FiberEntry)(void*);

#if !CGCPU_ASM_SWITCH
inline void ucontext_trampoline(unsigned int entry_hi, unsigned int entry_lo, unsigned int arg_hi,
                                unsigned int arg_lo) {
  const std::uintptr_t entry = (static_cast<std::uintptr_t>(entry_hi) << 32) | entry_lo;
  const std::uintptr_t arg = (static_cast<std::uintptr_t>(arg_hi) << 32) | arg_lo;
  reinterpret_cast<FiberEntry>(entry)(reinterpret_cast<void*>(arg));
  die("a fiber returned from its entry function");
}
#endif

// Prepares `context` to run entry(arg) on [stack, stack + size) when first switched to.
inline void context_make(Context& context, char* stack, std::size_t size, FiberEntry entry, void* arg) {
#if CGCPU_ASM_SWITCH
  std::uintptr_t top = (reinterpret_cast<std::uintptr_t>(stack) + size) & ~static_cast<std::uintptr_t>(15);
  void** frame = reinterpret_cast<void**>(top - 64);
  unsigned int mxcsr = __builtin_ia32_stmxcsr();
  unsigned short x87;
  __asm__ volatile("fnstcw %0" : "=m"(x87));
  std::uint64_t control = mxcsr | (static_cast<std::uint64_t>(x87) << 32);
  frame[0] = reinterpret_cast<void*>(control);                  // MXCSR, x87 control word
  frame[1] = nullptr;                                           // r15
  frame[2] = nullptr;                                           // r14
  frame[3] = reinterpret_cast<void*>(entry);                    // r13
  frame[4] = arg;                                               // r12
  frame[5] = nullptr;                                           // rbx
  frame[6] = nullptr;                                           // rbp: end of the frame chain
  frame[7] = reinterpret_cast<void*>(&cgcpu_fiber_start);       // return address
  context.sp = frame;
#else
  if (!context.made) {
    if (getcontext(&context.uc) != 0) die("getcontext failed");
    context.made = true;
  }
  context.uc.uc_stack.ss_sp = stack;
  context.uc.uc_stack.ss_size = size;
  context.uc.uc_link = nullptr;
  const std::uintptr_t e = reinterpret_cast<std::uintptr_t>(entry);
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(arg);
  makecontext(&context.uc, reinterpret_cast<void (*)()>(&ucontext_trampoline), 4,
              static_cast<unsigned int>(e >> 32), static_cast<unsigned int>(e),
              static_cast<unsigned int>(a >> 32), static_cast<unsigned int>(a));
#endif
}

// Saves the running context in `from` and resumes `to`. `to_stack`/`to_size` describe the
// stack `to` runs on (for ASan). Returns when something switches back to `from`.
__attribute__((noinline)) inline void context_switch(Context& from, Context& to, const void* to_stack,
                                                     std::size_t to_size) {
#if CGCPU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, to_stack, to_size);
#else
  (void)to_stack;
  (void)to_size;
#endif
#if CGCPU_ASM_SWITCH
  void* const target = to.sp;  // read as this context's, before TSan is told of the switch
#endif
  tsan_switch(to);
#if CGCPU_ASM_SWITCH
  cgcpu_fiber_switch(&from.sp, target);
#else
  if (swapcontext(&from.uc, &to.uc) != 0) die("swapcontext failed");
#endif
#if CGCPU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
  __asm__ volatile("" ::: "memory");
}

// Leaves a context for good (a fiber that has finished or is abandoned).
[[noreturn]] __attribute__((noinline)) CGCPU_NO_TSAN inline void context_leave(Context& from, Context& to,
                                                                 const void* to_stack,
                                                                 std::size_t to_size) {
#if CGCPU_ASAN
  __sanitizer_start_switch_fiber(nullptr, to_stack, to_size);  // frees this fiber's fake stack
#else
  (void)to_stack;
  (void)to_size;
#endif
  tsan_switch(to);
#if CGCPU_ASM_SWITCH
  cgcpu_fiber_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
  die("a finished fiber was resumed");
}

// The first thing a new fiber does (tells ASan that the switch into it has completed).
inline void fiber_started() {
#if CGCPU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
}

// Stacks of `count` fibers, `size` bytes each, with a guard page below each.
class StackRegion {
 public:
  StackRegion() = default;
  StackRegion(const StackRegion&) = delete;
  StackRegion& operator=(const StackRegion&) = delete;
  ~StackRegion() { release(); }

  void ensure(std::size_t count, std::size_t size) {
    if (count <= count_ && size == size_) return;
    release();
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    size_ = (size + page - 1) / page * page;
    stride_ = size_ + page;
    count_ = count;
    bytes_ = stride_ * count_;
    void* memory = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (memory == MAP_FAILED) die("cannot map fiber stacks (CG_CPU_STACK_KIB too large?)");
    base_ = static_cast<char*>(memory);
    for (std::size_t i = 0; i < count_; ++i)
      if (mprotect(base_ + i * stride_, page, PROT_NONE) != 0) die("cannot protect a stack guard page");
    guard_ = page;
  }
  char* stack(std::size_t i) const { return base_ + i * stride_ + guard_; }
  // Whether `p` is in one of the guard pages (a fiber overflowed its stack).
  bool in_guard(const void* p) const {
    const char* c = static_cast<const char*>(p);
    if (base_ == nullptr || c < base_ || c >= base_ + bytes_) return false;
    return static_cast<std::size_t>(c - base_) % stride_ < guard_;
  }
  std::size_t size() const { return size_; }

 private:
  void release() {
    if (base_ != nullptr) munmap(base_, bytes_);
    base_ = nullptr;
    count_ = 0;
  }
  char* base_ = nullptr;
  std::size_t count_ = 0, size_ = 0, stride_ = 0, bytes_ = 0, guard_ = 0;
};

}  // namespace detail
}  // namespace cgcpu
