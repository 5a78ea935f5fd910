"""Context parallelism (with data and tensor parallelism, inside fully_shard) against one process; bad input.

Tolerances, derived:
- fp32: a context-parallel run reorders fp32 sums that one process does in another order:
  each query chunk's softmax over its own key range, key/value gradients summed over the cp
  ranks by the reduce-scatter, parameter gradients summed over dp x cp ranks by the engine,
  and the loss as a sum divided by N/W instead of a mean. Each fp32 run of these models is
  within 5e-7 (measured, worst: attention-projection and norm gradients, small differences
  of large terms) of the float64 gradients, so two runs differ by up to 1e-6 (measured:
  9e-7 at tp 2 x cp 2), and SGD (linear in the gradients) keeps the weights that close: 2e-6.
- FP8 (current scaling, cp 2): each rank scales its own part of the sequence (per-tensor
  scales of its activations and their gradients), so the reference quantizes each rank's
  part on its own (a linear layer acts per token) and takes the sharded run's weights before
  every step; then every FP8 byte and scale is the same and what differs is the fp32 order
  above, as in test_tp_engine.py's FP8 bound: 1e-5. (One process quantizing the whole
  sequence at once differs by FP8 noise, ~1e-1 of these gradients: it is another recipe.)
"""

from __future__ import annotations

import pytest

from tests.dist import cp_workers as workers
from tests.harness import run_on_ranks

FP32_TOL = 2e-6
FP8_TOL = 1e-5
CHECKED = {"loss", "logits, first chunk", "logits, last chunk", "embedding grad, first chunk's rows",
           "embedding grad, last chunk's rows"}


def _check(results, tol):
    for worst in results:
        bad = {k: v for k, v in worst.items() if not v <= tol}
        assert CHECKED <= set(worst) and not bad, f"off by more than {tol:g} relative: {bad}"
        assert any(k.startswith("grad:") for k in worst) and any(k.startswith("weight:") for k in worst)


# sp: sequence parallel (each cp rank's part split again over tp); lp: vocabulary-sharded
# logits and the loss under loss_parallel() (the loss divided by loss_divisor there too).
@pytest.mark.parametrize("dp, cp, tp, sp, lp", [
    (1, 2, 1, False, False),
    (1, 4, 1, False, False),
    (2, 2, 1, False, False),
    (1, 2, 2, False, False),
    (1, 2, 2, True, True),
])
def test_llama_parity(dp, cp, tp, sp, lp):
    _check(run_on_ranks(dp * cp * tp, workers.parity, False, dp, cp, tp, sp, lp), FP32_TOL)


def test_llama_hsdp_and_activation_checkpointing():
    # dp_replicate 2 x cp 2: the loss divisor counts tokens over the replicas too; each block's
    # recomputed forward gathers its keys and values again.
    _check(run_on_ranks(4, workers.parity, False, 1, 2, 1, False, False, 2, False, {"checkpoint_activations": True}),
           FP32_TOL)


@pytest.mark.parametrize("dp, cp, tp, sp, lp", [(1, 2, 1, False, False), (2, 2, 1, False, False), (1, 2, 2, True, True)])
def test_hf_llama_parity(dp, cp, tp, sp, lp):
    pytest.importorskip("transformers")
    _check(run_on_ranks(dp * cp * tp, workers.parity, True, dp, cp, tp, sp, lp), FP32_TOL)


def test_fp8_current_scaling_parity():
    _check(run_on_ranks(2, workers.parity, False, 1, 2, 1, False, False, 1, True, None, 3), FP8_TOL)


SEQ_6 = ("sequence length 6 is not divisible by 4: context parallelism over cp=2 ranks cuts every sequence into "
         "2 x cp = 4 equal chunks (two per rank, so causal work is balanced)")
BAD = {
    "not_a_known_model": "context_parallel knows fsdp8's Llama and Hugging Face models, not Sequential; in your own "
                         "model's attention call attend = fsdp8.parallel.cp.ContextAttention(mesh)",
    "mesh_without_cp": "mesh with dimensions ('dp_shard',) has no 'cp' dimension; build the world mesh with "
                       "fsdp8.make_mesh(cp=N, ...) and pass it, or its mesh['cp']",
    "llama_twice": "already replaced (context_parallel applied twice?); apply it once",
    "odd_sequence": SEQ_6 + "; pad or cut sequences to a multiple of 4",
    "odd_local_tokens": "this rank holds 3 tokens of each sequence: " + SEQ_6,
    "longer_than_max_seq_len": "this rank's 8 tokens per sequence are part of sequences of 16 tokens over cp=2, "
                               "more than max_seq_len=8; build the model with a larger max_seq_len",
    "padding_mask": "attention_mask has padding (zeros): context-parallel attention is causal over whole sequences",
    "unknown_key": "shard_sequence does not know how to cut ['token_type_ids']",
    "hf_twice": "already context-parallel (context_parallel applied twice?); apply it once",
    "hf_without_registry": "OldStyleLlama's attention does not go through transformers' attention-function registry",
    "hf_not_causal": "LlamaForCausalLM has non-causal attention (model.layers.1.self_attn, ...)",
    "hf_softcap": "Gemma2ForCausalLM caps its attention logits (attn_logit_softcapping=50.0)",
    "hf_sliding_window": "MistralAttention has a sliding window of 4 tokens, shorter than the sequences (16)",
    "hf_attention_mask": "a context-parallel model takes no attention_mask",
    "hf_unshifted_labels": "labels without shift_labels: the model would shift this rank's part of the labels",
    "hf_positional": "a context-parallel Hugging Face model takes its batch as keyword arguments",
    "sp_without_tp": "sequence_parallel=True, but the mesh has no tp dimension: pass the world mesh from "
                     "fsdp8.make_mesh(cp=, tp=)",
    "sp_sequence": SEQ_6 + ", and sequence parallelism splits each rank's part over tp=2; pad or cut sequences to a "
                           "multiple of 4",
    "sp_local_tokens": "this rank holds 3 tokens of each sequence: " + SEQ_6 + ", and sequence parallelism",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_on_every_rank_before_any_collective(name):
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    tp = 2 if name in ("sp_sequence", "sp_local_tokens") else 1
    for message, gathers in run_on_ranks(2 * tp, workers.bad_input, name, tp):
        assert message is not None and BAD[name] in message, message
        assert gathers == 0  # the check came before the first key/value all-gather
