#!/usr/bin/env python3
"""Schedules with concurrent branches (cgConcurrently) for the cost model's tests and for
docs/performance-model.md's figures: written out, they are ordinary .cg files that import
the shipped schedules' pieces (cgForwardSaved, cgClassifier, the saved backward's start,
middle and end, cgOptimizer, with whatever branches those hold). Not shipped schedules.

- bucketed.cg: the data-parallel step with its all-reduce in buckets, on the saving
  backward's turned loop (backward.cg, cgSavedBackward): layer l's MLP bucket (four gradient
  entries, one call each) beside the end of its backward and the start of layer l - 1's,
  its attention bucket (four more) beside the middle of layer l - 1's; layer 0's attention
  bucket after the scatter, its sort beside the forward; the embedding's and the final
  norm's gradients after the backward; never two collectives at once (the checker accepts
  it in config gpt2). bucketed_nested.cg: each layer's eight entries, each bucket beside the
  whole backward below it (branches nested twelve deep; the checker refuses it, its
  collectives overlap: it exercises the cost model's nesting at depth).
- products.cg: the one-GPU step with each layer's weight-gradient products beside the
  input-gradient chain they do not touch (the attention output's beside the attention
  backward and, nested inside, the QKV weight gradient's beside the layer norm's), and the
  scatter's one-block sort beside the forward and backward (the checker accepts it).

    python3 scripts/branch_examples.py FOLDER     # writes the three files into FOLDER
    python3 scripts/cost_model.py --file FOLDER/products.cg
    python3 scripts/cost_model.py --ranks 1,2,4,8 --parallel FOLDER/bucketed.cg
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = os.path.join(ROOT, "schedules")

IMPORTS = """\
import "{schedules}/forward.cg"
import "{schedules}/backward.cg"
import "{schedules}/optimizer.cg"

--- The embedding's scatter in its two launches, written here (the shipped schedules'
--- names for them change): the sort reads only the step's ids.
def exampleSort : (family NvidiaLaunchSchedule) =
  (cgPhase cgPhaseScatter
    (cgLaunch cgImageScatterOrder 1 1 1
      (cgPointer (cgArgument 0) (cgArena cgScatterOrder)
        (cgPointer (cgArgument 1) cgIds cgNoSlots))))

def exampleSorted : (family NvidiaLaunchSchedule) =
  (cgPhase cgPhaseScatter
    (cgLaunch cgImageScatterSorted cgSeq 1 1
      (cgPointer (cgArgument 0) (cgParameter cgBankG cgEmbeddingEntry)
        (cgPointer (cgArgument 1) (cgArena cgDy0)
          (cgPointer (cgArgument 2) cgIds
            (cgPointer (cgArgument 3) (cgArena cgScatterOrder) cgNoSlots))))))
"""

BUCKETS = """
--- One all-reduce call over one gradient view, in place.
def exampleAllReduce : ((Buffer float32) -> Schedule) =
  (lambda unrestricted b : (Buffer float32) .
    (cgLaunch cgImageAllReduce 1 1 1
      (cgPointer (cgArgument 0) b (cgSlot (cgScalar 0) (cgCount b) cgNoSlots))))

--- Layer l's buckets: its MLP's four gradient entries, its attention's four, one call each,
--- and the eight together.
def exampleBucketMlp : (Nat -> Schedule) =
  (lambda unrestricted l : Nat .
    (cgPhase cgPhaseAllReduce
      (cgThen (exampleAllReduce (cgGradientOf cgFcWeight l))
      (cgThen (exampleAllReduce (cgGradientOf cgProjWeight l))
      (cgThen (exampleAllReduce (cgGradientOf cgLn2Gamma l))
        (exampleAllReduce (cgGradientOf cgLn2Beta l)))))))

def exampleBucketAttention : (Nat -> Schedule) =
  (lambda unrestricted l : Nat .
    (cgPhase cgPhaseAllReduce
      (cgThen (exampleAllReduce (cgGradientOf cgQkvWeight l))
      (cgThen (exampleAllReduce (cgGradientOf cgOutputWeight l))
      (cgThen (exampleAllReduce (cgGradientOf cgLn1Gamma l))
        (exampleAllReduce (cgGradientOf cgLn1Beta l)))))))

def exampleBucket : (Nat -> Schedule) =
  (lambda unrestricted l : Nat . (cgThen (exampleBucketMlp l) (exampleBucketAttention l)))

--- The gradients that are not a layer's: the embedding's (the scatter's too) and the final
--- layer norm's, after the backward.
def exampleRest : (family NvidiaLaunchSchedule) =
  (cgPhase cgPhaseAllReduce
    (cgThen (exampleAllReduce (cgParameter cgBankG cgEmbeddingEntry))
    (cgThen (exampleAllReduce (cgParameter cgBankG cgFinalGamma))
      (exampleAllReduce (cgParameter cgBankG cgFinalBeta)))))

--- The saving backward's turned loop's start, as a phase (library.cg's middle and end are
--- phases of their own).
def exampleStart : (Nat -> Schedule) =
  (lambda unrestricted l : Nat . (cgPhase cgPhaseLayerBackward (cgLayerBackwardSavedStart l)))
"""


def bucketed_source(layers: int, nested: bool = False) -> str:
    """The bucketed data-parallel step for a model of `layers` layers (written out: the
    language has no recursion to build the chain from cgLayers)."""
    def end(layer):  # a layer's end, then the layer below's start (the scatter at layer 0)
        after = f"(exampleStart {layer - 1})" if layer else "exampleSorted"
        return f"(cgLayerBackwardSavedEnd {layer} {after})"

    def middle(layer):
        return f"(cgLayerBackwardSavedMiddle {layer})"
    top = layers - 1
    if nested:  # each layer's whole bucket beside everything below its end
        chain = "(exampleBucket 0)"
        for layer in range(1, layers):
            chain = f"(cgConcurrently (exampleBucket {layer})\n  (cgThen {middle(layer - 1)} " \
                    f"(cgThen {end(layer - 1)} {chain})))"
        chain = f"(cgThen {end(top)} {chain})"
    else:
        chain = f"(cgThen (cgConcurrently (exampleBucketMlp 0) {end(0)})\n  " \
                f"(exampleBucketAttention 0))"
        for layer in range(1, layers):
            chain = f"(cgThen (cgConcurrently (exampleBucketMlp {layer}) {end(layer)})\n  " \
                    f"(cgThen (cgConcurrently (exampleBucketAttention {layer}) " \
                    f"{middle(layer - 1)})\n  {chain}))"
    chain = f"(cgThen (exampleStart {top}) (cgThen {middle(top)}\n  {chain}))"
    entry = "exampleBucketedNestedStep" if nested else "exampleBucketedStep"
    return IMPORTS.format(schedules=SCHEDULES) + BUCKETS + f"""
def {entry} : (family NvidiaLaunchSchedule) =
  (cgThen (cgConcurrently exampleSort cgForwardSaved)
    (cgThen (cgClassifier (cgArena cgDy0) (cgArena cgGradientLow))
      (cgThen {chain}
        (cgThen exampleRest cgOptimizer))))
"""


PRODUCTS = """
--- A layer's saved backward with each weight gradient's product beside the chain it does not
--- touch: dW_proj | dX_proj, dW_fc | dX_fc, dW_out | (dX_out ... the first layer norm's
--- backward), and inside the last, dW_qkv | (dX_qkv, the layer norm's backward). The first
--- layer norm's low copy cannot go to cgGradientLow, which dW_out reads beside it (the
--- checker refuses the race): it goes to a buffer of its own, which the layer below (or,
--- for the top layer, the classifier's layer norm) fills and its first products read.
arena exampleSpareLow low cgSeqWidth

def exampleLayerProducts : (Nat -> Schedule) =
  (lambda unrestricted layer : Nat .
    (cgPhase cgPhaseLayerBackward
      (cgThen
        (cgConcurrently
          (cgProductWeightSet cgWidth4 cgWidth cgSeq (cgGradientOf cgProjWeight layer)
            (cgItem (cgArena cgSavedFcAct) layer) (cgArena exampleSpareLow))
          (cgProductTransposedGeluBackward cgSeq cgWidth4 cgWidth (cgArena cgGradientFc)
            (cgArena exampleSpareLow) (cgHalfOf cgProjWeight layer)
            (cgItem (cgArena cgSavedFcPre) layer)))
      (cgThen
        (cgConcurrently
          (cgProductWeightSet cgWidth cgWidth4 cgSeq (cgGradientOf cgFcWeight layer)
            (cgItem (cgArena cgSavedNormed2) layer) (cgArena cgGradientFc))
          (cgProductTransposed cgSeq cgWidth cgWidth4 (cgArena cgGradientNormed)
            (cgArena cgGradientFc) (cgHalfOf cgFcWeight layer)))
      (cgThen
        (cgLayerNormBackwardAdd (cgWeightOf cgLn2Gamma layer) (cgGradientOf cgLn2Gamma layer)
          (cgGradientOf cgLn2Beta layer) (cgItem (cgArena cgSavedMiddle) layer)
          (cgArena cgGradientNormed) (cgItem (cgArena cgSavedStatistics2) layer)
          (cgArena cgDy0) (cgArena cgDy1) (cgArena cgGradientLow))
        (cgConcurrently
          (cgProductWeightSet cgWidth cgWidth cgSeq (cgGradientOf cgOutputWeight layer)
            (cgItem (cgArena cgSavedAttention) layer) (cgArena cgGradientLow))
          (cgThen
            (cgProductTransposedLow cgSeq cgWidth cgWidth (cgArena cgGradientAttention)
              (cgArena cgGradientLow) (cgHalfOf cgOutputWeight layer))
          (cgThen
            (cgLaunch cgImageAttentionDelta cgSeq 1 1
              (cgPointer (cgArgument 0) (cgArena cgAttentionDelta)
                (cgPointer (cgArgument 1) (cgItem (cgArena cgSavedAttention) layer)
                  (cgPointer (cgArgument 2) (cgArena cgGradientAttention) cgNoSlots))))
          (cgThen
            (cgLaunch cgImageAttentionBackward cgHeads cgBatch
              cgAttentionBackwardBlocks
              (cgPointer (cgArgument 0) (cgArena cgGradientQkv)
                (cgPointer (cgArgument 1) (cgItem (cgArena cgSavedQkv) layer)
                  (cgPointer (cgArgument 2) (cgArena cgGradientAttention)
                    (cgPointer (cgArgument 3) (cgItem (cgArena cgSavedAttentionLse) layer)
                      (cgPointer (cgArgument 4) (cgArena cgAttentionDelta) cgNoSlots))))))
            (cgConcurrently
              (cgProductWeightSet cgWidth cgWidth3 cgSeq (cgGradientOf cgQkvWeight layer)
                (cgItem (cgArena cgSavedNormed1) layer) (cgArena cgGradientQkv))
              (cgThen
                (cgProductTransposed cgSeq cgWidth cgWidth3 (cgArena cgGradientNormed)
                  (cgArena cgGradientQkv) (cgHalfOf cgQkvWeight layer))
                (cgLayerNormBackwardAdd (cgWeightOf cgLn1Gamma layer)
                  (cgGradientOf cgLn1Gamma layer) (cgGradientOf cgLn1Beta layer)
                  (cgBoundary layer) (cgArena cgGradientNormed)
                  (cgItem (cgArena cgSavedStatistics1) layer) (cgArena cgDy1)
                  (cgArena cgDy0) (cgArena exampleSpareLow)))))))))))))

def exampleProductsStep : (family NvidiaLaunchSchedule) =
  (cgThen
    (cgConcurrently exampleSort
      (cgThen cgForwardSaved
        (cgThen (cgClassifier (cgArena cgDy0) (cgArena exampleSpareLow))
          (nvidiaAffineLaunchRepeat cgLayers
            (lambda unrestricted fromTop : Nat .
              (exampleLayerProducts
                (naturalSaturatingSubtract (naturalSaturatingSubtract cgLayers 1) fromTop)))))))
    (cgThen exampleSorted cgOptimizer))
"""


def products_source() -> str:
    """The one-GPU step with its products' branches (same launches as train.cg's step)."""
    return IMPORTS.format(schedules=SCHEDULES) + PRODUCTS


def write(folder: str, layers: int = 12) -> dict:
    """The three files in `folder` (GPT-2 small's 12 layers unless told): name -> path."""
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for name, text in (("bucketed.cg", bucketed_source(layers)),
                       ("bucketed_nested.cg", bucketed_source(layers, nested=True)),
                       ("products.cg", products_source())):
        paths[name] = os.path.join(folder, name)
        with open(paths[name], "w") as handle:
            handle.write(text)
    return paths


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    for path in write(sys.argv[1]).values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from cgc.outputs import script_status
    sys.exit(script_status(main))
