"""benchmarks/tpu_step.py: its JAX twin is the recipe's model, its profile reading, and a CPU smoke run.

The chip numbers come from running the script on a TPU (see its docstring); here, on CPU, the parts
that must be right before that run: the twin trains exactly as the recipe's torch model does (float32,
losses through three AdamW steps), Hugging Face's Llama with the recipe's weights computes the same
loss, TPU op names fall in the right categories, and a tiny run writes every field the report reads.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)

import jax_twin  # noqa: E402
import tpu_step  # noqa: E402
import xla_profile  # noqa: E402

from tpudist.training.model import ModelArgs, Transformer  # noqa: E402

ARGS = ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=g),
            torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=g))


def test_twin_trains_as_the_recipe_float32():
    import jax.numpy as jnp

    torch.manual_seed(0)
    model = Transformer(ARGS)
    x, y = _batch()
    params = jax_twin.params_from_torch(model)  # copied before torch trains in place
    hp = jax_twin.AdamW()
    opt = torch.optim.AdamW(model.parameters(), **hp.torch_kwargs())
    step = jax_twin.make_train_step(ARGS, hp)
    state = jax_twin.adamw_init(params)
    jx, jy = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    for _ in range(3):  # the first loss checks the model, the next two AdamW
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        params, state, twin_loss = step(params, state, jx, jy)
        assert abs(float(twin_loss) - loss.item()) <= 1e-5 * abs(loss.item()), (float(twin_loss), loss.item())
    assert int(state["step"]) == 3


def test_hf_llama_with_the_recipes_weights_computes_the_same_loss():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with torch.no_grad():  # sharp attention (at init it is nearly uniform, whatever q and k hold)
        for block in model.layers:
            block.attention.wq.weight.mul_(30)
            block.attention.wk.weight.mul_(30)
    hf = tpu_step.hf_from_recipe(model, ARGS)
    x, y = _batch()
    with torch.no_grad():
        expected = tpu_step._loss(model, x, y).item()  # noqa: SLF001
        got = tpu_step._loss(hf, x, y).item()  # noqa: SLF001
        assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)
        # the rotary permutation matters: without it the loss differs
        for block, layer in zip(model.layers, hf.model.layers):
            layer.self_attn.q_proj.weight.copy_(block.attention.wq.weight)
            layer.self_attn.k_proj.weight.copy_(block.attention.wk.weight)
        assert abs(tpu_step._loss(hf, x, y).item() - expected) > 1e-3  # noqa: SLF001


def test_flops_per_step_formula():
    args = ModelArgs(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, max_seq_len=1024)
    matmul_params = args.num_params() - 32000 * 1024 - 17 * 1024
    assert matmul_params == 8 * (1024 * 64 * (2 * 16 + 2 * 8) + 3 * 1024 * 2736) + 32000 * 1024
    assert tpu_step.flops_per_step(args, 8, 1024) == 6 * matmul_params * 8192 + 6 * 8 * 1024 ** 2 * 1024 * 8


# TPU XLA Ops event names as the chip's profile spells them: (name, short name, opcode, shapes, category)
OP_NAMES = [
    ("%convolution_reduce_fusion.3 = bf16[8,1024,2736]{2,1,0:T(8,128)(2,1)} fusion(bf16[8,1024,1024]{2,1,0} %p0, "
     "bf16[1024,2736]{1,0} %p1), kind=kOutput, calls=%fused_computation.3",
     "convolution_reduce_fusion.3", "fusion", [(8, 1024, 2736)], "matmul"),
    ("%fusion.12 = f32[8,16,1024,1024]{3,2,1,0:T(8,128)} fusion(bf16[8,16,1024,64]{3,2,1,0} %a), kind=kLoop",
     "fusion.12", "fusion", [(8, 16, 1024, 1024)], "attention scores"),
    ("%fusion.13 = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(bf16[1024,1024]{1,0} %w), kind=kLoop",
     "fusion.13", "fusion", [(1024, 1024)], "other"),  # a weight: 2-d, not attention though dim == seq
    ("%copy.5 = bf16[1024,1024]{0,1:T(8,128)(2,1)} copy(bf16[1024,1024]{1,0} %p)",
     "copy.5", "copy", [(1024, 1024)], "copy/transpose"),
    ("%transpose_fusion = bf16[8,8,1024,64]{3,2,1,0} fusion(bf16[8,1024,8,64]{3,2,1,0} %k), kind=kLoop",
     "transpose_fusion", "fusion", [(8, 8, 1024, 64)], "copy/transpose"),
    ("%all-reduce.1 = f32[10]{0} all-reduce(f32[10]{0} %x), replica_groups={}", "all-reduce.1", "all-reduce",
     [(10,)], "collective"),
    ("%fusion.7 = (bf16[8,1024]{1,0}, f32[8,1024]{1,0}) fusion(bf16[8,1024,1024]{2,1,0} %h), kind=kInput",
     "fusion.7", "fusion", [(8, 1024), (8, 1024)], "other"),
    ("dot_general.16", "dot_general.16", "", [], "matmul"),  # XLA:CPU thunk names
    ("add_convert_fusion.45", "add_convert_fusion.45", "", [], "other"),
]


@pytest.mark.parametrize("name,short,opcode,shapes,category", OP_NAMES)
def test_op_names_parse_and_categorize(name, short, opcode, shapes, category):
    assert xla_profile.parse_op(name) == (short, opcode, shapes)
    assert xla_profile.categorize(short, opcode, shapes, seq=1024) == category


def test_a_copy_is_summed_by_the_type_and_layout_it_makes():
    assert xla_profile.result_type("%copy.113 = bf16[8,16,1024,64]{3,2,1,0:T(8,128)(2,1)} copy(%a)") == \
        "bf16[8,16,1024,64]{3,2,1,0:T(8,128)(2,1)}"
    assert xla_profile.result_type("%fusion.7 = (bf16[8]{0}, f32[8]{0}) fusion(%h)") == ""  # a tuple
    assert xla_profile.result_type("copy.113") == ""  # an XLA:CPU thunk's bare name


def test_what_made_an_op_comes_from_its_stats_or_its_metadata():
    text = '%fusion.80 = bf16[4000,8,8,128]{3,2,1,0} fusion(%p), metadata={op_name="jit(step)/scatter-add" source_line=3}'
    assert xla_profile.what_of(text, {}) == "jit(step)/scatter-add"
    assert xla_profile.what_of(text, {"tf_op": "jit(step)/embedding"}) == "jit(step)/embedding"
    assert xla_profile.what_of("%fusion.80 = bf16[8]{0} fusion(%p)", {"hlo_category": "x"}) == ""


def test_busy_time_is_the_union_of_program_runs():
    assert xla_profile._union_ns([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # noqa: SLF001
    assert xla_profile._union_ns([]) == 0  # noqa: SLF001


def test_timeline_places_programs_and_idle_time_within_the_step():
    ms = 1_000_000
    modules = [("fwd", 12 * ms, 30 * ms), ("bwd", 50 * ms, 60 * ms), ("read", 111 * ms, 1 * ms),
               ("earlier_step", 1 * ms, 5 * ms), ("overlap", 55 * ms, 2 * ms)]
    tl = xla_profile.timeline((10 * ms, 118 * ms), modules)
    assert tl["step_ms"] == 108
    assert [(p["name"], p["start_ms"], p["ms"], p["idle_before_ms"]) for p in tl["programs"]] == [
        ("fwd", 2, 30, 2), ("bwd", 40, 60, 8), ("overlap", 45, 2, 0), ("read", 101, 1, 1)]
    assert tl["idle_after_ms"] == 6
    line = xla_profile.format_summary({"device": None, "timeline": tl, "categories": dict.fromkeys(
        xla_profile.CATEGORIES, {"s_per_step": 0.0, "share": 0.0}), "ops_s_per_step": 0.0, "top_ops": []}, 0.1, 1.0)
    assert any("idle 8.0 | bwd 60.0" in text and "idle to the step's end 6.0" in text for text in line), line


def test_tiny_cpu_run_writes_the_report_fields(tmp_path):
    out = tmp_path / "tpu_step.json"
    cmd = [sys.executable, os.path.join(BENCHMARKS, "tpu_step.py"), "--tiny", "--layers", "1", "--seq", "32",
           "--modes", "twin,fused", "--steps", "2", "--unsynced-steps", "2", "--json", str(out)]
    # Fused in chunks of its backward's graph: step 1 (AdamW's state made) is cut where step 2 is
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TPUDIST_FUSED_BACKWARD_CHUNK": "20"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["name"] == "tpu_step" and record["complete"] and record["exit_code"] == 0
    parsed = record["parsed"]
    assert set(parsed["modes"]) == {"twin", "fused"}
    for name, mode in parsed["modes"].items():
        assert mode["status"] == "ok", (name, mode.get("error"))
        assert len(mode["step_s"]) == 2 and mode["median_step_s"] > 0 and mode["tokens_per_s"] > 0
        assert mode["step1"]["compiles"]["xla_compiles"] >= 1  # cold cache: the first step compiles
        assert mode["steady_compiles"]["xla_compiles"] == 0
        # steps read once at the end run the synced steps' programs: nothing compiles
        assert mode["unsynced"]["steps"] == 2 and mode["unsynced"]["step_s"] > 0
        assert mode["unsynced"]["compiles"]["xla_compiles"] == 0, mode["unsynced"]["compiles"]
        assert mode["unsynced"]["compiles"].get("device_programs", 0) == 0, mode["unsynced"]["compiles"]
        assert mode["profile"]["device"] is None and mode["profile"]["source"].startswith("host thunks")
        assert mode["profile"]["top_ops"]
        copies = mode["profile"]["top_copies"]  # listed apart: where layout changes go
        assert all(op["category"] == "copy/transpose" for op in copies), copies
    # Fused builds its step's program in step 1 only (issue #37 item 4): step 2 builds none, counted
    assert parsed["modes"]["fused"]["step1"]["compiles"]["device_programs"] >= 1
    assert parsed["modes"]["fused"]["step2"]["compiles"]["device_programs"] == 0
    assert parsed["modes"]["fused"]["step1"]["compiles"]["device_syncs"] > 2  # the chunks ran: more programs
    assert parsed["modes"]["fused"]["settings"]["TPUDIST_FUSED_BACKWARD_CHUNK"] == "20"
    assert parsed["modes"]["twin"]["settings"] == {}
    # same weights, same batch: the same first loss (bf16 rounding apart)
    assert parsed["first_loss_rel_diff_vs_twin"]["fused"] < 1e-2
    assert {t["key"] for t in parsed["targets"]} == {k for k, *_ in tpu_step.TARGETS}
    assert "fused_over_twin_step" in parsed["ratios"]
    assert "summary" in record["output"]
    import report  # benchmarks/report.py renders the record as RESULTS.md's TPU section

    page = "\n".join(report.render_tpu(record))
    assert page.startswith("## On the chip: cpu") and "| JAX twin |" in page
    assert "| Fused with " in page and "`TPUDIST_FUSED_BACKWARD_CHUNK=20`" in page
    assert "compiled tokens/s / twin tokens/s | - | >= 0.9 | n/a" in page  # no compiled run here
    # a chip's profile names what made an op (XLA:CPU's does not): the page shows it with the op
    record["parsed"]["modes"]["fused"]["profile"]["top_ops"][0]["what"] = "jit(step)/scatter-add"
    assert "(`jit(step)/scatter-add`)" in "\n".join(report.render_tpu(record))


def test_layers_compiled_apart_share_their_programs(tmp_path):
    """``--modes layers``: three layers compiled one by one are one forward graph and one backward graph,
    built in step 1, and train as the twin does (its first loss)."""
    out = tmp_path / "tpu_step.json"
    cmd = [sys.executable, os.path.join(BENCHMARKS, "tpu_step.py"), "--tiny", "--layers", "3", "--seq", "32",
           "--modes", "twin,layers", "--steps", "1", "--unsynced-steps", "1", "--profile-steps", "0",
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    parsed = json.loads(out.read_text())["parsed"]
    mode = parsed["modes"]["layers"]
    assert mode["status"] == "ok", mode.get("error")
    assert mode["step1"]["compiles"]["compile_graphs"] == 2, mode["step1"]["compiles"]
    assert mode["step2"]["compiles"]["compile_graphs"] == 0 and mode["steady_compiles"]["xla_compiles"] == 0
    assert parsed["first_loss_rel_diff_vs_twin"]["layers"] < 1e-2


def test_add_to_keeps_the_earlier_runs_other_modes(tmp_path):
    from types import SimpleNamespace

    config = {"dim": 64, "layers": 1, "heads": 4, "kv_heads": 2, "vocab": 128, "seq": 32, "batch": 2,
              "dtype": "bfloat16"}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"parsed": {"config": config, "modes": {
        "twin": {"status": "ok", "median_step_s": 1.0}, "strict": {"status": "skipped", "why": "deadline"}}}}))
    results = {"config": dict(config), "modes": {}}
    tpu_step._add_earlier(SimpleNamespace(add_to=str(earlier), modes=["strict"]), results, lambda text: None)  # noqa: SLF001
    assert list(results["modes"]) == ["twin"] and results["modes"]["twin"]["from"] == str(earlier)
    with pytest.raises(ValueError, match=r"another model or batch: \(earlier, now\) \{'seq': \(32, 64\)\}"):
        tpu_step._add_earlier(SimpleNamespace(add_to=str(earlier), modes=["strict"]),  # noqa: SLF001
                              {"config": {**config, "seq": 64}, "modes": {}}, lambda text: None)


def test_a_mode_kept_twice_names_the_run_that_measured_it(tmp_path):
    from types import SimpleNamespace

    config = {"dim": 64, "layers": 1, "heads": 4, "kv_heads": 2, "vocab": 128, "seq": 32, "batch": 2,
              "dtype": "bfloat16"}
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps({"started_utc": "A", "command": "strict alone", "parsed": {
        "config": config, "modes": {"strict": {"status": "ok", "median_step_s": 1.0}}}}))
    results = {"config": dict(config), "modes": {"twin": {"status": "ok", "median_step_s": 0.1}}}
    tpu_step._add_earlier(SimpleNamespace(add_to=str(first), modes=["twin"]), results, lambda text: None)  # noqa: SLF001
    assert results["modes"]["strict"]["run"] == {"started_utc": "A", "command": "strict alone"}
    second.write_text(json.dumps({"started_utc": "B", "command": "the main run", "parsed": results}))
    again = {"config": dict(config), "modes": {}}
    tpu_step._add_earlier(SimpleNamespace(add_to=str(second), modes=["compiled"]), again, lambda text: None)  # noqa: SLF001
    assert again["modes"]["strict"]["run"]["started_utc"] == "A"  # not B, which only kept it
    assert again["modes"]["twin"]["run"]["started_utc"] == "B"
    assert again["added_from"]["started_utc"] == "B"


def test_a_mode_with_settings_runs_under_them(monkeypatch):
    monkeypatch.delenv("TPUDIST_SHAPED_STORAGE", raising=False)
    with tpu_step._mode_environment("compiled_shaped"):  # noqa: SLF001
        assert os.environ["TPUDIST_SHAPED_STORAGE"] == "1"
        assert tpu_step.device_settings()["TPUDIST_SHAPED_STORAGE"] == "1"
    assert "TPUDIST_SHAPED_STORAGE" not in os.environ
    with tpu_step._mode_environment("compiled"):  # noqa: SLF001
        assert "TPUDIST_SHAPED_STORAGE" not in os.environ
    ok = {"status": "ok", "median_step_s": 2.0, "mfu": 0.1, "tokens_per_s": 1.0, "step1": {"s": 1.0}}
    r = tpu_step.ratios({"compiled": ok, "compiled_shaped": {**ok, "median_step_s": 1.0}})
    assert r["compiled_shaped_over_compiled_step"] == 0.5
