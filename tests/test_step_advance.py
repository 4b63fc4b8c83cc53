"""Decode steps chained on the GPU inside one submit (kernels/step_advance.py): the kernel's log and
StepParams against the values it must leave, and a submit of decode steps that needs no buffer copy
between its steps yet gives the tokens of one step at a time."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_web.kernels.common import StepParams
from bitnet_web.kernels.step_advance import StepAdvance

pytestmark = pytest.mark.gpu

TINY = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=500, context_length=96, seed=11)
PROMPT = [3, 140, 141, 7, 400, 12]


def test_each_advance_logs_the_chosen_id_at_its_slot_and_moves_the_step_on(device, kernels):
    ids = device.buffer(16, label="ids")
    step = StepParams(device)
    advance = StepAdvance(kernels, ids, step, slots=4)
    step.write(1, 41, 128, slot=0)
    chosen = [17, 9, 300, 4, 55]  # the fifth lands past the log's 4 slots: never written
    for token in chosen:
        device.upload(ids, 0, np.asarray([token], dtype=np.uint32))
        rec = device.begin()
        advance.record(rec)
        rec.submit()
    staging = device.staging(16, "log")
    rec = device.begin()
    advance.copy_log(rec, staging, 4)
    rec.submit()
    assert device.read_sync(step.buffer, 0, 16).view(np.uint32).tolist() == [1, 41 + 5, 128, 5]
    assert device.read_sync(advance.log, 0, 16).view(np.uint32).tolist() == chosen[:4]
    advance.release(device)


@pytest.mark.parametrize("steps", [1, 5])
def test_a_submit_of_chained_steps_has_one_pass_and_the_tokens_of_single_steps(engine, steps):
    """k decode steps recorded into one submit run in a single compute pass (a copy between steps
    would end it), and give the argmax of the logits that single forward steps give, fed back one
    by one; StepParams are left at the step after the last."""
    model = engine.model
    expected = []
    model.truncate(0)
    logits = engine._run(model.forward(PROMPT))
    for _ in range(steps + 1):
        expected.append(int(np.argmax(logits)))
        logits = engine._run(model.forward([expected[-1]]))

    model.truncate(0)
    engine._run(model.prefill(PROMPT[:-1]))
    first_pos = model.n_cached
    model.device.upload(model.token_ids, 0, np.asarray([PROMPT[-1]], dtype=np.uint32))
    staging = model.device.staging(64, "tokens")
    rec = model._record_gpu_steps(model.argmax, first_pos, steps, staging)
    assert rec.passes == 1, "a copy between the steps ended the compute pass"
    rec.submit()
    model.device.start_read(staging)
    tokens = engine._run(model.device.read_staging(staging, 4 * steps)).view(np.uint32).tolist()
    assert tokens == expected[:steps]
    params = model.device.read_sync(model.step.buffer, 0, 16).view(np.uint32).tolist()
    assert params[1] == first_pos + steps and params[3] == steps
    model.device.release(staging)
    model.truncate(0)


def test_a_submit_of_speculative_steps_is_one_pass_whose_log_holds_each_steps_output(engine):
    """Verify steps chained in one submit: one compute pass, and the log copied out holds, per step,
    n_emitted, the emitted tokens and the draft length, which continue the greedy reply exactly."""
    model = engine.model
    k, n_steps = 2, 3
    prompt = PROMPT * 3  # repeats: the lookup drafts
    model.truncate(0)
    greedy = []
    logits = engine._run(model.forward(prompt))
    for _ in range(n_steps * (k + 1)):
        greedy.append(int(np.argmax(logits)))
        logits = engine._run(model.forward([greedy[-1]]))

    model.truncate(0)
    engine._run(model.prefill(prompt[:-1]))
    ops = model._speculation_ops(k)
    ops.buffers.start(model.cached_tokens + [prompt[-1]], model.kv_cache.capacity)
    model.kv_cache.ensure_capacity(model.n_cached + n_steps * (k + 1))
    staging = model.device.staging(4 * (k + 3) * n_steps, "verify log")
    rec = model._record_verify_steps(k, n_steps, k + 1, staging, model.n_cached, ops.greedy)
    assert rec.passes == 1, "a copy between the steps ended the compute pass"
    rec.submit()
    model.device.start_read(staging)
    words = engine._run(model.device.read_staging(staging, 4 * (k + 3) * n_steps)).view(np.uint32)
    emitted = []
    for j in range(n_steps):
        row = words[(k + 3) * j : (k + 3) * (j + 1)].tolist()
        assert 1 <= row[0] <= k + 1 and row[k + 2] <= k
        emitted += row[1 : 1 + row[0]]
    assert emitted == greedy[: len(emitted)]
    model.device.release(staging)
    model.truncate(0)
