"""LoRA in the FSDP2 learner group (``learner.lora``), on CPU over gloo: a step moves only the adapters
and moves the loss; the reference is the base (adapters off); W=2 equals W=1; a checkpoint holds the
adapters and their optimizer state and resumes bit-exactly, also at another world size; the export is
a merged folder plus a PEFT folder that peft loads onto the base with the merged folder's log-probs."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.learner.checkpoint import step_dir
from services.learner.group import LearnerGroup
from services.common.lora import is_adapter

pytestmark = pytest.mark.slow
LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}


def _cfg(cfg, **learner):
    lora = cfg.learner.lora.model_copy(update=LORA)
    return cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"lora": lora, **learner})})


def test_a_lora_step_moves_only_the_adapters_and_w2_equals_w1(ray_cluster, setup, world):
    cfg, tb = setup
    cfg = _cfg(cfg, kl_coef=0.01)
    init = load_file(str(world / "model" / "model.safetensors"))
    out = {}
    for w in (1, 2):
        group = LearnerGroup(cfg, str(world / "model"), world_size=w)
        try:
            first = group.train_step(tb)
            assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # B = 0: the policy is the base, its reference
            second = group.train_step(tb)
            out[w] = (first, second, group.full_state_dict("peft"), group.full_state_dict(),
                      group.full_state_dict("adapter"))
        finally:
            group.shutdown()
    (f1, s1, raw1, merged1, adapters1), (f2, s2, raw2, merged2, _) = out[1], out[2]
    assert s1["kl"] > 0  # the first update moved the policy off its base (its reference)
    assert f1["pg_loss"] == pytest.approx(f2["pg_loss"], rel=1e-5, abs=1e-7)
    for k, v in raw1.items():
        if is_adapter(k):
            torch.testing.assert_close(v, raw2[k], rtol=1e-5, atol=1e-5)
        elif k.replace(".base_layer.", ".") in init:  # the base is frozen: bit-equal to the model's file
            assert torch.equal(v, init[k.replace(".base_layer.", ".")]), k
    assert any(float(v.abs().max()) > 0 for k, v in raw1.items() if ".lora_B." in k)
    # learner.lora.publish=adapter sends the adapters alone, as trained
    assert set(adapters1) == {k for k in raw1 if is_adapter(k)}
    assert all(torch.equal(v, raw1[k]) for k, v in adapters1.items())
    assert set(init) <= set(merged1) and not any("lora_" in k or "base_layer" in k for k in merged1)
    assert max(float((merged1[k] - init[k]).abs().max()) for k in init) > 1e-5  # the merge carries the update


@pytest.fixture(scope="module")
def uninterrupted_lora(ray_cluster, setup, world):
    """``uninterrupted_lora(world_size)``: (peft state dict, optimizer digest) after 3 uninterrupted LoRA steps,
    the reference the resume cases compare with; run once per world size for the module (both cases resume
    onto W=2), not once per case."""
    cfg, tb = setup
    cfg = _cfg(cfg)
    runs: dict[int, tuple] = {}

    def run(world_size: int) -> tuple:
        if world_size not in runs:
            ref = LearnerGroup(cfg, str(world / "model"), world_size=world_size)
            try:
                for _ in range(3):
                    ref.train_step(tb)
                runs[world_size] = (ref.full_state_dict("peft"), ref.optimizer_digest())
            finally:
                ref.shutdown()
        return runs[world_size]

    return run


@pytest.mark.parametrize("before,after", [(2, 2), (1, 2)])
def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_exactly(ray_cluster, setup, world, tmp_path,
                                                                       before, after, uninterrupted_lora):
    cfg, tb = setup
    cfg = _cfg(cfg)
    model = str(world / "model")
    expected = uninterrupted_lora(after)
    run = str(tmp_path / "run")
    first = LearnerGroup(cfg, model, world_size=before)
    try:
        first.train_step(tb)
        first.save_checkpoint(run, 1)
    finally:
        first.shutdown()
    meta = json.loads((step_dir(run, 1) / "trainer.json").read_text())
    assert meta["kept"]["lora"]["rank"] == LORA["rank"]
    # the adapters and their optimizer state only: far smaller than the model
    size = sum(f.stat().st_size for f in step_dir(run, 1).glob("*.distcp"))
    assert size < 0.5 * (world / "model" / "model.safetensors").stat().st_size
    second = LearnerGroup(cfg, model, world_size=after)
    try:
        assert second.resume(run)["step"] == 1
        for _ in range(2):
            second.train_step(tb)
        got = (second.full_state_dict("peft"), second.optimizer_digest())
    finally:
        second.shutdown()
    if before == after:  # the same reductions in the same order: bit-exact
        for k in expected[0]:
            assert torch.equal(got[0][k], expected[0][k]), k
        assert got[1] == expected[1]
    else:  # resharded: the gradients' sums run in another order (test_fsdp.py's tolerance)
        for k in expected[0]:
            torch.testing.assert_close(got[0][k], expected[0][k], rtol=1e-5, atol=1e-5)


def test_a_full_checkpoint_does_not_resume_into_a_lora_learner(ray_cluster, setup, world, tmp_path):
    cfg, tb = setup
    run = str(tmp_path / "run")
    full = LearnerGroup(cfg, str(world / "model"), world_size=1)
    try:
        full.save_checkpoint(run, 1)
    finally:
        full.shutdown()
    group = LearnerGroup(_cfg(cfg), str(world / "model"), world_size=1)
    try:
        with pytest.raises(Exception, match="holds every parameter but this learner trains LoRA adapters"):
            group.resume(run)
    finally:
        group.kill()


def test_the_export_is_merged_plus_a_peft_folder_with_the_same_logprobs(ray_cluster, setup, world, tmp_path):
    cfg, tb = setup
    cfg = _cfg(cfg)
    group = LearnerGroup(cfg, str(world / "model"), world_size=2)
    try:
        for _ in range(2):
            group.train_step(tb)
        out = group.export_hf(str(tmp_path / "policy"), str(world / "model"))
    finally:
        group.shutdown()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, f"{out}/adapter")
    ids = torch.as_tensor(tb.input_ids[:64]).long()[None]
    plain = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    with torch.no_grad():
        a, b, c = (torch.log_softmax(m(input_ids=ids).logits.float(), -1) for m in (merged, peft, plain))
    assert (a - b).abs().max() < 1e-3
    assert (a - c).abs().max() > 1e-4  # trained, not the base
