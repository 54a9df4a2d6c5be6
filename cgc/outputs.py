"""The one writer of every file cgc writes for a user (`-o`, `--log`, `--plot`, `--trace`,
dumps, checkpoints, `fmt`, `doc`): what is at the path decides how it is written.

- A regular file, or nothing yet: the bytes go to a temporary file beside it, flushed to the
  disk, given the old file's mode (and owner, where allowed), and renamed onto it: a full
  disk or a kill leaves the old file (or none), never a cut one.
- A character or block device, a FIFO or a terminal: opened for writing and written in
  place. Nothing is renamed over it, so a device node stays a device node (`-o /dev/null`
  as root replaced the machine's /dev/null once).
- A symbolic link: followed, through any chain, and its target written by these rules; the
  link stays a link. A link to one of this process's descriptors (/dev/stdout, /dev/fd/N,
  /proc/self/fd/N) is that descriptor, written where it stands (a `>>` stays an append).
- A read-only file (no write bit in its mode, checked as such: root passes os.access) is
  refused, never replaced behind its mode; so is a folder, a socket, and an output that is
  one of the command's own inputs (`check`, called before any work).

Two kinds of failure: `Refused` (nothing was written: exit 2, a path the command line should
not have named) and `WriteFailed` (a write that the disk or device refused: exit 1).
"""

from __future__ import annotations

import contextlib
import io
import errno
import os
import re
import stat
import sys
import tempfile
from typing import Iterable

TEMPORARY_SUFFIX = ".cgc-tmp"
_LINKS_FOLLOWED = 40  # as the kernel's ELOOP limit
_DESCRIPTOR = re.compile(r"^/(?:proc/(?:self|thread-self|(\d+))|dev)/fd/(\d+)$")


class Refused(Exception):
    """An output cgc will not write; nothing was written (exit 2)."""


class WriteFailed(Exception):
    """An output whose writing failed: a full disk, a device that refuses (exit 1)."""


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _where(path: str, what: str | None) -> str:
    return f"{what} {path}" if what else str(path)


def resolve(path: str) -> str | int:
    """Where writing `path` lands: a file descriptor of this process (int) for a link to one
    (/dev/stdout), else the path with every symbolic link followed (the last one may name
    nothing yet). OSError ELOOP for a cycle."""
    current = os.path.abspath(os.fspath(path))
    for _ in range(_LINKS_FOLLOWED):
        folder, name = os.path.split(current)
        if name in ("", ".", ".."):
            return os.path.realpath(current)
        current = os.path.join(os.path.realpath(folder), name)
        for candidate in (os.path.join(folder, name), current):
            found = _DESCRIPTOR.match(candidate)
            if found and (found.group(1) is None or int(found.group(1)) == os.getpid()):
                return int(found.group(2))
        try:
            link = os.readlink(current)
        except OSError as error:
            if error.errno in (errno.EINVAL, errno.ENOENT):  # not a link, or nothing there
                return current
            raise
        current = os.path.join(os.path.dirname(current), link)
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)


def _status(target: str | int) -> os.stat_result | None:
    try:
        return os.fstat(target) if isinstance(target, int) else os.stat(target)
    except FileNotFoundError:
        return None


def _in_place(mode: int) -> bool:
    """A device, a FIFO (terminals are character devices): written where it stands."""
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode)


def _refusal(path: str, target, status) -> str | None:
    """Why `path` cannot be written (whatever the command), or None."""
    if status is None:  # nothing there yet: its folder must take a new file
        folder = os.path.dirname(target)
        if not os.path.isdir(folder):
            return "No such file or directory"
        if not os.access(folder, os.W_OK | os.X_OK):
            return "Permission denied"
        return None
    mode = status.st_mode
    if stat.S_ISDIR(mode):
        return "Is a directory"
    if stat.S_ISSOCK(mode) and not isinstance(target, int):
        return "a socket, which cgc does not write"
    if not isinstance(target, int) and (stat.S_ISREG(mode) or _in_place(mode)):
        if not mode & 0o222:  # root would pass os.access: the mode says read-only
            return "the file is read-only"
        if not os.access(target, os.W_OK):
            return "Permission denied"
        if stat.S_ISREG(mode) and not os.access(os.path.dirname(target), os.W_OK | os.X_OK):
            return "Permission denied (its folder takes no new file, and cgc writes the " \
                   "new bytes beside the old before replacing them)"
    return None


def _located(path: str):
    try:
        target = resolve(path)
        return target, _status(target)
    except OSError as error:
        raise Refused(f"cannot write {path}: {_reason(error)}") from None


def check(path: str, inputs: Iterable[str] = (), option: str | None = None) -> None:
    """Refused where `path` cannot or must not be written: before any work is done, so that
    a command never computes what it will fail to write. `inputs`: the files the command
    reads (schedules and their imports, data, checkpoints); an output that is one of them
    (the same file: by inode, through links and hard links) is refused. `option` names the
    output in that message (`--log`)."""
    target, status = _located(path)
    problem = _refusal(path, target, status)
    if problem:
        raise Refused(f"cannot write {path}: {problem}")
    if status is not None:
        same = same_file_among(status, inputs)
        if same is not None:
            shown = "" if os.path.abspath(same) == os.path.abspath(path) else f" ({same})"
            raise Refused(f"{option + ' ' if option else ''}{path} is one of this command's "
                          f"inputs{shown}: cgc never writes over what it reads; give another "
                          "path")


def same_file_among(status: os.stat_result, paths: Iterable[str]) -> str | None:
    for path in paths:
        try:
            other = os.stat(path)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (status.st_dev, status.st_ino):
            return path
    return None


def files_under(paths: Iterable[str | None]) -> list[str]:
    """The paths, a folder as every file under it (what a command may read from it)."""
    found = []
    for path in paths:
        if not path:
            continue
        if os.path.isdir(path):
            found += [os.path.join(folder, name)
                      for folder, _, names in os.walk(path) for name in names]
        else:
            found.append(path)
    return found


def check_command(outputs: dict[str, str | None], inputs: Iterable[str] = (),
                  replaced_folders: dict[str, str | None] | None = None,
                  folders: dict[str, str | None] | None = None) -> None:
    """Every output of one command, by option (`--log`: path), checked as `check` does, and
    against each other: two options naming one file are refused, as is an input, another
    output or an output folder (`folders`: `--checkpoint-dir`) inside a folder the command
    replaces whole (`replaced_folders`: `--dump`). A device or FIFO may take several
    outputs: it is written in place, each output in turn."""
    inputs = list(inputs)
    seen: dict[object, str] = {}
    for option, path in outputs.items():
        if not path or path == "-":
            continue
        check(path, inputs, option)
        target, status = _located(path)
        if status is not None and not stat.S_ISREG(status.st_mode):
            continue  # a device or FIFO takes every output in turn (--log /dev/null twice)
        key = (status.st_dev, status.st_ino) if status is not None else target
        if key in seen:
            raise Refused(f"{seen[key]} and {option} name the same file ({path}): each "
                          "output needs its own")
        seen[key] = option
    for option, folder in (replaced_folders or {}).items():
        if not folder:
            continue
        inside = os.path.realpath(folder) + os.sep
        others = {**outputs, **(folders or {})}
        for other, path in [*((f"{o} {p}", p) for o, p in others.items() if p),
                            *((f"the input {p}", p) for p in inputs)]:
            if (os.path.realpath(path) + os.sep).startswith(inside):
                raise Refused(f"{option} {folder} is replaced whole, and {other} is inside "
                              "it: give it a path outside the folder")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_all(handle, data: bytes) -> None:
    """The file's bytes, in pieces of 1 MiB (a kill between two pieces leaves a partial
    temporary file, which is what tests/test_checkpoint.py does to prove it is never read)."""
    view = memoryview(data)
    for start in range(0, len(view), 1 << 20):
        handle.write(view[start:start + (1 << 20)])


def _write_descriptor(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(descriptor, view[:1 << 20])
        view = view[written:]


def _open_in_place(target: str) -> int:
    """A device or FIFO opened for writing: never created, never truncated."""
    return os.open(target, os.O_WRONLY | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))


def _temporary_beside(target: str, status: os.stat_result | None) -> tuple[int, str]:
    """A new file in `target`'s folder, with the mode (and owner, where allowed) of the file
    it will replace, or a new file's mode."""
    folder, name = os.path.split(target)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=TEMPORARY_SUFFIX,
                                             dir=folder)
    try:
        os.fchmod(descriptor, stat.S_IMODE(status.st_mode) if status is not None
                  else 0o666 & ~_umask())
        if status is not None and hasattr(os, "fchown"):
            mine = os.fstat(descriptor)
            if (mine.st_uid, mine.st_gid) != (status.st_uid, status.st_gid):
                try:
                    os.fchown(descriptor, status.st_uid, status.st_gid)
                except OSError:
                    pass  # only root may give a file away: it stays the writer's
    except BaseException:
        os.close(descriptor)
        os.unlink(temporary)
        raise
    return descriptor, temporary


def _prepared(path: str, what: str | None):
    target, status = _located(path)
    problem = _refusal(path, target, status)
    if problem:
        raise Refused(f"cannot write {_where(path, what)}: {problem}")
    return target, status


def write_file(path: str, data: str | bytes, what: str | None = None) -> bool:
    """`data` (text as UTF-8) into `path`, by the rules above. Refused where nothing could be
    written; WriteFailed where the writing failed (a regular file is then as it was). False
    where a pipe's reader left before the end (no error: nothing to say it was written)."""
    from .resources import sync_to_disk
    data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    target, status = _prepared(path, what)
    try:
        if isinstance(target, int):  # a descriptor we were given (/dev/stdout)
            import sys
            for stream in (sys.stdout, sys.stderr):
                stream.flush()  # what was printed before comes first
            _write_descriptor(target, data)
            return True
        if status is not None and not stat.S_ISREG(status.st_mode):
            descriptor = _open_in_place(target)
            try:
                _write_descriptor(descriptor, data)
            finally:
                os.close(descriptor)
            return True
        descriptor, temporary = _temporary_beside(target, status)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                _write_all(handle, data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
        sync_to_disk(os.path.dirname(target))  # the rename itself
        return True
    except BrokenPipeError:  # a pipe's reader left (`-o /dev/stdout | head`, a FIFO's): no
        if isinstance(target, int):  # error, as for what is printed
            reader_gone(target)
        return False
    except OSError as error:
        raise WriteFailed(f"cannot write {_where(path, what)}: {_reason(error)}") from None


# ---- the standard streams ------------------------------------------------------------------
# A reader that left (`cgc ... | head`, `2>&1 | head`: EPIPE) is no error: the command goes on
# quietly to its own status (a run stops after the step under way); a standard output the
# device refuses (`> /dev/full`, ENOSPC) is one line and exit 1, whatever was printing; an
# error message that cannot be written is lost, and the status still says it. The same for
# cgc's commands (cli.py) and the scripts (script_status).

def discard(stream) -> None:
    """Later writes to `stream` (a stream or a descriptor), and what its buffer still holds
    (which the interpreter flushes at exit), go to the null device: its reader left or its
    device refused."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream if isinstance(stream, int) else stream.fileno())
    except (OSError, ValueError, AttributeError):  # not a descriptor (a StringIO): left be
        pass
    finally:
        os.close(devnull)


@contextlib.contextmanager
def descriptors_kept(streams):
    """The descriptors under `streams` (a library caller's sys.stdout and sys.stderr) as they
    were before the block, whatever it discarded (a reader that left: discard puts the null
    device there, for a process that is about to end). What their buffers hold by then goes
    where the block left it, so nothing of the block's is written after."""
    saved = {}
    for stream in streams:
        try:
            descriptor = stream.fileno()
            saved.setdefault(descriptor, (stream, os.dup(descriptor)))
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass  # no descriptor (a StringIO, a closed stream): nothing to keep
    try:
        yield
    finally:
        for descriptor, (stream, copy) in saved.items():
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
            try:
                if not os.path.samestat(os.fstat(descriptor), os.fstat(copy)):
                    os.dup2(copy, descriptor)
            except OSError:
                pass
            finally:
                os.close(copy)


def reader_gone(descriptor: int) -> None:
    """The reader of `descriptor` left. During a command (standard_streams_told): discarded,
    and if it is the standard output's (an output written to /dev/stdout), the standard
    output says so (StandardOutput.reader_left), as it does for what is printed. Outside one
    (a library call) the descriptor is the caller's, left as it is: write_file's False says
    what happened."""
    if not isinstance(sys.stdout, StandardOutput):
        return
    discard(descriptor)
    if _same_file(descriptor, sys.stdout):
        sys.stdout.gone = sys.stdout.reader_left = True


def _same_file(descriptor: int, stream) -> bool:
    try:
        return os.path.samestat(os.fstat(descriptor), os.fstat(stream.fileno()))
    except (OSError, ValueError, AttributeError):
        return False


class _Guarded:
    """A standard stream during a command: writes go to `stream` until it fails (`gone`:
    nothing more is written to it). A reader that left (EPIPE): the stream is discarded and
    `reader_left` set, and the command goes on to its own end and status, writing into
    nothing; another failure: `_failed`."""

    gone = False
    reader_left = False

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, act) -> None:
        if not self.gone:
            try:
                act()
            except BrokenPipeError:
                self.gone = self.reader_left = True
                discard(self._stream)
            except OSError as error:
                self._failed(error)

    def write(self, text: str) -> int:
        self._guarded(lambda: self._stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def write_bytes(self, data: bytes) -> None:
        """`data` as it is (another process's output passed on: `cgc run --ranks N`), after
        what was written before it; a stream with no bytes under it (a StringIO) takes it
        as UTF-8 text."""
        def act() -> None:
            self._stream.flush()
            try:
                descriptor = self._stream.fileno()
            except (AttributeError, ValueError, io.UnsupportedOperation):  # a StringIO
                self._stream.write(data.decode("utf-8", "replace"))
            else:  # every byte, however few each write takes (a disk filling up)
                _write_descriptor(descriptor, data)
        self._guarded(act)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class StandardOutput(_Guarded):
    """sys.stdout during a command (standard_streams_told); a run's loop reads
    `reader_left` and stops after its step. A write the device refuses: WriteFailed, naming
    the standard output, what is left discarded (the interpreter's own flush at exit would
    fail again)."""

    def _failed(self, error: OSError) -> None:
        discard(self._stream)
        raise WriteFailed(f"cannot write the standard output: {_reason(error)}") from None


class StandardError(_Guarded):
    """sys.stderr during a command: what cannot be written (a full device) is lost, as when
    its reader left; the exit status still tells the outcome."""

    def _failed(self, error: OSError) -> None:
        self.gone = True
        discard(self._stream)


@contextlib.contextmanager
def standard_streams_told():
    """sys.stdout and sys.stderr as StandardOutput and StandardError for the block (over the
    null device where the process has none: Python's None, `>&-`), the streams themselves
    again after it."""
    streams = sys.stdout, sys.stderr
    null = open(os.devnull, "w") if None in streams else None
    sys.stdout, sys.stderr = (kind(stream if stream is not None else null)
                              for kind, stream in zip((StandardOutput, StandardError), streams))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
        if null is not None:
            null.close()


def finish_output(status: int, program: str) -> int:
    """The status of a command that returned `status`, once what it printed is flushed: a
    reader that left changes nothing (the status is the command's); a refused write is one
    line (`program: error: ...`) and 1 if the command had succeeded."""
    try:
        sys.stdout.flush()  # a StandardOutput: a reader that left is no error there
    except WriteFailed as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        return status or 1
    return status


def script_status(main, program: str | None = None) -> int:
    """`main()` (a script's, or cgc's own command) under the rules above, named `program`
    (the script's file name where not given): a reader that left changes nothing but what
    is printed, a refused write is one line and 1, never a traceback; its status otherwise,
    and its own exceptions and exits as they are (an exit with status 0, such as --help's,
    becomes 1 if what it printed was refused)."""
    if program is None:
        program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script"
    with standard_streams_told():
        try:
            status = main()
        except WriteFailed as error:  # the standard output's, or another output cgc wrote
            print(f"{program}: error: {error}", file=sys.stderr)
            return 1
        except (Exception, KeyboardInterrupt, SystemExit) as ending:  # the program's own:
            # kept, what it printed flushed first (a reader that left: into nothing)
            if finish_output(0, program) and isinstance(ending, SystemExit) \
                    and not ending.code:
                return 1
            raise
        return finish_output(status, program)


class Stream:
    """An output written as it goes (`--log`): text lines, each flushed. Opened by the same
    rules: a regular file (or none) is replaced at once by a new empty file beside it (its
    mode kept), or appended to with `append`; a device or FIFO is written in place."""

    def __init__(self, path: str, append: bool = False, what: str | None = None):
        self.path, self.what = path, what
        target, status = _prepared(path, what)
        try:
            if isinstance(target, int):
                self.descriptor, self.owned = target, False
            elif status is not None and not stat.S_ISREG(status.st_mode):
                self.descriptor, self.owned = _open_in_place(target), True
            elif append and status is not None:
                self.descriptor = os.open(target, os.O_WRONLY | os.O_APPEND |
                                          getattr(os, "O_CLOEXEC", 0))
                self.owned = True
            else:
                self.descriptor, temporary = _temporary_beside(target, status)
                self.owned = True
                try:
                    os.replace(temporary, target)
                except BaseException:
                    os.close(self.descriptor)
                    os.unlink(temporary)
                    raise
        except OSError as error:
            raise WriteFailed(f"cannot write {_where(path, what)}: {_reason(error)}") from None

    @property
    def name(self) -> str:
        return self.path

    def write(self, text: str) -> None:
        try:
            _write_descriptor(self.descriptor, text.encode("utf-8"))
        except BrokenPipeError:  # a pipe's reader left (`--log /dev/stdout | head`)
            raise
        except OSError as error:
            raise WriteFailed(f"cannot write {_where(self.path, self.what)}: "
                              f"{_reason(error)}") from None

    def flush(self) -> None:
        """Every write goes straight to the descriptor: nothing is held back."""

    def close(self) -> None:
        if self.owned and self.descriptor >= 0:
            descriptor, self.descriptor = self.descriptor, -1
            os.close(descriptor)


def new_file(path: str):
    """A file that must not exist yet, in a folder cgc made (a dump's staging folder): opened
    exclusively (never through a link put there), flushed to the disk when closed."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         getattr(os, "O_CLOEXEC", 0), 0o666)
    return _Synced(os.fdopen(descriptor, "wb"))


class _Synced:
    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self.handle

    def __exit__(self, kind, value, traceback):
        try:
            if kind is None:
                self.handle.flush()
                os.fsync(self.handle.fileno())
        finally:
            self.handle.close()
        return False
