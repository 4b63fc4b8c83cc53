"""Every published BitNet b1.58 shape against transformers, from a Hugging Face folder and from GGUF.

Each case is a tiny random checkpoint with a published model's true hidden width, head layout, FFN
width and head tying, but one layer and a small vocabulary (515 entries, a multiple of nothing the
kernels tile by); transformers (BitNetForCausalLM, or LlamaForCausalLM for the Llama-layout ones) is the
reference. The engine pads widths that are not multiples of 128 and heads of 96/100 dims, and repeats
KV heads for GQA ratios over one workgroup (model/layout.py): these tests are what shows that the
padding changes nothing. Checked: logits at every prompt position (the tolerance of
test_transformers_reference.py; argmax and tokens wherever the top-2 gap exceeds 4x the observed
difference) from the folder and from the GGUF `convert` writes, and 16 greedy
tokens of the engine's own decode loop.

The widths are real, so lavapipe takes 15-70 s per case: all are marked slow (the quick check runs
test_layout.py's layout arithmetic instead).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_tiny import build_tiny_bitnet, load_tiny_bitnet  # noqa: E402

from bitnet_web.convert.convert_hf import convert  # noqa: E402
from bitnet_web.engine import Engine  # noqa: E402
from bitnet_web.text.sampler import SamplerSettings  # noqa: E402

pytestmark = pytest.mark.gpu

# Of the reference's logit range: test_transformers_reference.py's 0.4%, widened for the f16 KV cache.
# The reference rounds K and V to f16 as the engine does (hf_tiny.round_kv_to_f16), and most positions
# agree to ~1e-4; but where the two sides' float32 key or value lies on either side of an f16 rounding
# midpoint they round one f16 step apart, which can flip an int8 activation after attention: measured
# up to 0.55% of the range on these one-layer models (1bitLLM-3B, Llama3-8B-1.58).
RELATIVE_TOLERANCE = 0.007
PROMPT = 12
GREEDY_STEPS = 16
SMALL_VOCAB = 515  # not a multiple of anything the kernels tile by
EXTRA_WINDOWS = 24  # random 4-token prompts tried after the prompt's own windows for the greedy check

BITNET = dict(model_type="bitnet")
LLAMA = dict(model_type="llama", hidden_act="silu", tied=False)  # Falcon3-*-1.58bit, HF1BitLLM
# name -> build_tiny_bitnet arguments
PREFILL_CHUNK = 16  # the engine fixture's (tests/conftest.py)
SHAPES = {
    # microsoft/bitnet-b1.58-2B-4T: relu^2, 20 heads of 128 over 5 KV heads, tied
    "bitnet-2B-4T": dict(
        BITNET, hidden_size=2560, num_attention_heads=20, num_key_value_heads=5, intermediate_size=6912
    ),
    # 1bitLLM/bitnet_b1_58-large: SiLU, 16 heads of 96, FFN 4096 (its vocabulary of 32002 makes random
    # logits near-tie too often for a greedy check: the small odd vocabulary stands in)
    "1bitLLM-large": dict(
        BITNET,
        hidden_act="silu",
        tied=False,
        hidden_size=1536,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=4096,
    ),
    # 1bitLLM/bitnet_b1_58-3B: 32 heads of 100, FFN 8640 (not a multiple of 128)
    "1bitLLM-3B": dict(
        BITNET,
        hidden_act="silu",
        tied=False,
        hidden_size=3200,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8640,
    ),
    # tiiuae/Falcon3-1B-Instruct-1.58bit: 8 heads of 256 over 4 KV heads
    "Falcon3-1B": dict(LLAMA, hidden_size=2048, num_attention_heads=8, num_key_value_heads=4, intermediate_size=8192),
    # tiiuae/Falcon3-3B-Instruct-1.58bit: 12 heads of 256 over 4
    "Falcon3-3B": dict(LLAMA, hidden_size=3072, num_attention_heads=12, num_key_value_heads=4, intermediate_size=9216),
    # tiiuae/Falcon3-7B- and 10B-Instruct-1.58bit (same widths, 28 / 40 layers): FFN 23040
    "Falcon3-7B-10B": dict(
        LLAMA, hidden_size=3072, num_attention_heads=12, num_key_value_heads=4, intermediate_size=23040
    ),
    # HF1BitLLM/Llama3-8B-1.58-100B-tokens: 32 heads of 128 over 8, FFN 14336
    "Llama3-8B-1.58": dict(
        LLAMA, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336
    ),
    # not published, the case the issue names: 12 query heads per KV head of 64 (over one workgroup)
    "gqa12-hd64": dict(BITNET, hidden_size=768, num_attention_heads=12, num_key_value_heads=1, intermediate_size=1000),
}


def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the logits each was chosen from (KV-cached decode)."""
    ids, chosen_from = list(prompt), []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(steps):
            logits = out.logits[0, -1].float().numpy()
            chosen_from.append(logits)
            ids.append(int(logits.argmax()))
            out = model(torch.tensor([[ids[-1]]]), cache=out.cache, use_cache=True)
    return ids[len(prompt) :], np.stack(chosen_from)


def _check_against(engine: Engine, source: str, hf_model, ids: list[int], what: str, greedy: bool = True) -> None:
    engine.load(source)
    ours = engine.logits(ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    assert ours.shape == theirs.shape, what
    tolerance = RELATIVE_TOLERANCE * float(theirs.max() - theirs.min())
    worst = np.abs(ours - theirs).max(axis=1)
    assert worst.max() <= tolerance, f"{what}: per-position max |diff| {worst} over {tolerance}"
    # Argmax and greedy tokens must agree wherever transformers' top-2 gap exceeds what the two sides
    # were seen to differ by (4x the worst logit difference, at least 1e-4 of the range): one layer
    # keeps that far below the tolerance (~2e-7 of the range measured), so close calls are checked too.
    tie = max(4 * float(worst.max()), 0.025 * tolerance)
    top2 = np.sort(theirs, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > tie
    assert decisive.sum() >= len(ids) // 2, f"{what}: too few decisive positions for the argmax check"
    assert (ours.argmax(1) == theirs.argmax(1))[decisive].all(), what
    if not greedy:
        return

    # The prompt: the first 4-token window (of `ids`, then random ones) after which transformers' 16
    # greedy steps have no near-tie, else the one with the longest run before its first near-tie (chosen
    # from the reference alone; a near-tie may go either way on either side). With the f16 KV cache the
    # sides differ by up to ~0.6% of the range at some positions (RELATIVE_TOLERANCE), so the tie margin
    # is wider and runs without a near-tie are shorter.
    windows = [ids[start : start + 4] for start in range(len(ids) - 3)]
    windows += np.random.default_rng(6).integers(0, hf_model.config.vocab_size, (EXTRA_WINDOWS, 4)).tolist()
    best = None
    for window in windows:
        expected_here, chosen_from = _hf_greedy(hf_model, window, GREEDY_STEPS)
        gap = np.diff(np.sort(chosen_from, axis=1)[:, -2:], axis=1)[:, 0]
        near_tie = np.nonzero(gap <= tie)[0]
        run = int(near_tie[0]) if len(near_tie) else GREEDY_STEPS
        if best is None or run > best[0]:
            best = (run, window, expected_here)
        if run == GREEDY_STEPS:
            break
    checked, prompt, expected = best
    # (some random one-layer models, e.g. the 2B-4T shape, greedily repeat one token: the logits at
    # every position above are then the informative check)
    # the reference never stops: a random model may pick the tiny vocabulary's end-of-text id or spell a
    # chat template's stop string, where the engine would end the reply (those stops are tested
    # elsewhere); here every step is compared (the next load restores both)
    engine.tokenizer.stop_ids, engine.template = frozenset(), None
    list(engine.generate(tokens=prompt, settings=SamplerSettings(temperature=0.0), max_tokens=GREEDY_STEPS))
    got = engine.generated_tokens
    assert checked >= GREEDY_STEPS // 2, f"{what}: reference has a near-tie at step {checked}"
    assert got[:checked] == expected[:checked], f"{what}: greedy tokens differ"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_published_shape_matches_transformers(engine, tmp_path, name):
    args = {"vocab_size": SMALL_VOCAB, **SHAPES[name]}
    folder = build_tiny_bitnet(tmp_path / "hf", num_hidden_layers=1, seed=11, max_position_embeddings=64, **args)
    hf_model = load_tiny_bitnet(folder)
    with torch.no_grad():  # the engine keeps embedding and head in F16, as the GGUF stores them
        for matrix in {id(m): m for m in (hf_model.get_input_embeddings(), hf_model.get_output_embeddings())}.values():
            matrix.weight.copy_(matrix.weight.half().float())
    ids = np.random.default_rng(5).integers(0, args["vocab_size"], PROMPT).tolist()

    _check_against(engine, str(folder), hf_model, ids, f"{name} from the Hugging Face folder")
    cfg = engine.model.config
    assert (cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
        args["hidden_size"],
        args["intermediate_size"],
        args["num_attention_heads"],
        args["num_key_value_heads"],
        args["vocab_size"],
    )
    assert cfg.tied_embeddings == args.get("tied", True)
    gguf_path = tmp_path / "model.gguf"
    convert(folder, gguf_path)
    # the same weights through a GGUF file (I2_S blocks spanning rows where K is not a multiple of 128)
    _check_against(engine, str(gguf_path), hf_model, ids, f"{name} from GGUF I2_S", greedy=False)
