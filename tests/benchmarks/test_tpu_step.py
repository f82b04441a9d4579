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


# splash attention's blocks are multiples of 128 (jax 0.10.2 refuses smaller ones, on CPU too): the twins'
# model runs at seq 128, where every attention runs on CPU (the Pallas ones in interpret mode)
TWIN_ARGS = ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
# float32 through 3 AdamW steps (issue #57): the twin and torch sum the same products in other orders
# (einsum vs matmul, online vs full softmax), ~1e-7 relative a loss; 1e-5 leaves room, and a model
# difference (a rotary pair, a kv head) moves the loss by more than 10x that (test_a_model_difference_...)
LOSS_RTOL = 1e-5


def _sharp_model(args):
    """The recipe's model with sharp attention (at init it is nearly uniform, whatever q and k hold: a
    wrong rotary pairing or kv head would hardly move the loss)."""
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for block in model.layers:
            block.attention.wq.weight.mul_(30)
            block.attention.wk.weight.mul_(30)
    return model


def _twin_batch(args):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=g),
            torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=g))


@pytest.mark.parametrize("attention", jax_twin.ATTENTIONS)
def test_twin_trains_as_the_recipe_float32(attention):
    import jax.numpy as jnp

    model = _sharp_model(TWIN_ARGS)
    x, y = _twin_batch(TWIN_ARGS)
    params = jax_twin.params_from_torch(model)  # copied before torch trains in place
    hp = jax_twin.AdamW()
    opt = torch.optim.AdamW(model.parameters(), **hp.torch_kwargs())
    step = jax_twin.make_train_step(TWIN_ARGS, hp, attention)
    state = jax_twin.adamw_init(params)
    jx, jy = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    for _ in range(3):  # the first loss checks the model, the next two AdamW
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        params, state, twin_loss = step(params, state, jx, jy)
        assert abs(float(twin_loss) - loss.item()) <= LOSS_RTOL * abs(loss.item()), (float(twin_loss), loss.item())
    assert int(state["step"]) == 3


def test_a_model_difference_moves_the_loss():
    """The comparison above can fail: q/k without the rotate-half permutation, or the kv heads paired with
    the wrong query heads, give another loss by far more than LOSS_RTOL."""
    import jax.numpy as jnp

    model = _sharp_model(TWIN_ARGS)
    x, y = _twin_batch(TWIN_ARGS)
    jx, jy = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    params = jax_twin.params_from_torch(model)
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert abs(float(jax_twin.loss_fn(params, jx, jy, TWIN_ARGS, "xla")) - expected) <= LOSS_RTOL * expected
    head_dim = TWIN_ARGS.head_dim
    unpermuted = [{**layer, "wq": jnp.asarray(block.attention.wq.weight.detach().numpy().reshape(-1, head_dim, 64)
                                                  .transpose(2, 0, 1))} for layer, block in zip(params["layers"],
                                                                                                   model.layers)]
    swapped = [{**layer, "wk": layer["wk"][:, ::-1], "wv": layer["wv"][:, ::-1]} for layer in params["layers"]]
    for layers in (unpermuted, swapped):
        got = float(jax_twin.loss_fn({**params, "layers": layers}, jx, jy, TWIN_ARGS, "xla"))
        assert abs(got - expected) > 10 * LOSS_RTOL * expected, (got, expected)


def test_twin_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match=r"attention='cudnn': the twin's attentions are xla, splash, flash"):
        jax_twin.make_train_step(TWIN_ARGS, jax_twin.AdamW(), "cudnn")
    import jax.numpy as jnp

    tokens = jnp.zeros((1, 96), jnp.int32)
    params = jax_twin.params_from_torch(Transformer(ModelArgs(vocab_size=128, dim=64, n_layers=1, n_heads=4,
                                                              n_kv_heads=2, max_seq_len=96)))
    with pytest.raises(ValueError, match=r"splash attention needs seq a multiple of 128 .* got seq=96"):
        jax_twin.forward(params, tokens, TWIN_ARGS, "splash")


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
     "fusion.12", "fusion", [(8, 16, 1024, 1024)], "attention"),
    ("%tpudist_flash_attention_dq.1 = bf16[8,16,1024,64]{3,2,1,0} custom-call(bf16[8,16,1024,64]{3,2,1,0} %q), "
     'custom_call_target="tpu_custom_call"', "tpudist_flash_attention_dq.1", "custom-call", [(8, 16, 1024, 64)],
     "attention"),
    ("%splash_mha_fwd_no_residuals.3 = bf16[16,1024,64]{2,1,0} custom-call(bf16[16,1024,64]{2,1,0} %q), "
     'custom_call_target="tpu_custom_call"', "splash_mha_fwd_no_residuals.3", "custom-call", [(16, 1024, 64)],
     "attention"),
    ("%custom-call.2 = bf16[8]{0} custom-call(bf16[8]{0} %x), custom_call_target=\"Sharding\"", "custom-call.2",
     "custom-call", [(8,)], "other"),
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


# An optimized HLO module as XLA dumps it (after_optimizations.txt), cut to what the fusion index reads:
# a matmul fused with its convert (convolution in a kOutput fusion: TPU's spelling), one fused as a dot two
# fusions deep (a nested fusion), an elementwise fusion, and two programs naming a fusion alike
HLO_MATMULS = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8,1024]{1,0})->bf16[8,2736]{1,0}}

FileLocations
1 {file_name_id=1 function_name_id=1 line=5}

%fused_computation (param_0: bf16[8,1024], param_1: bf16[1024,2736]) -> bf16[8,2736] {
  %param_0 = bf16[8,1024]{1,0} parameter(0)
  %param_1 = bf16[1024,2736]{1,0} parameter(1)
  %convolution.1 = f32[8,2736]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
  ROOT %convert.2 = bf16[8,2736]{1,0} convert(%convolution.1)
}

%inner_computation (p: f32[8,64], q: f32[64,64]) -> f32[8,64] {
  %p = f32[8,64]{1,0} parameter(0)
  %q = f32[64,64]{1,0} parameter(1)
  ROOT %dot.7 = f32[8,64]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.1 (param_0.1: f32[8,64], param_1.1: f32[64,64]) -> f32[8,64] {
  %param_0.1 = f32[8,64]{1,0} parameter(0)
  %param_1.1 = f32[64,64]{1,0} parameter(1)
  %inner = f32[8,64]{1,0} fusion(%param_0.1, %param_1.1), kind=kOutput, calls=%inner_computation
  ROOT %add.3 = f32[8,64]{1,0} add(%inner, %param_0.1)
}

%fused_computation.2 (param_0.2: bf16[8,2736]) -> bf16[8,2736] {
  %param_0.2 = bf16[8,2736]{1,0} parameter(0)
  ROOT %multiply.4 = bf16[8,2736]{1,0} multiply(%param_0.2, %param_0.2)
}

ENTRY %main.9 (x: bf16[8,1024], w: bf16[1024,2736], a: f32[8,64], b: f32[64,64]) -> bf16[8,2736] {
  %x = bf16[8,1024]{1,0} parameter(0)
  %w = bf16[1024,2736]{1,0} parameter(1)
  %a = f32[8,64]{1,0} parameter(2)
  %b = f32[64,64]{1,0} parameter(3)
  %fusion.3 = bf16[8,2736]{1,0:T(8,128)(2,1)} fusion(%x, %w), kind=kOutput, calls=%fused_computation, metadata={op_name="jit(step)/dot_general"}
  %fusion.4 = f32[8,64]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_computation.1
  ROOT %fusion.5 = bf16[8,2736]{1,0} fusion(%fusion.3), kind=kLoop, calls=%fused_computation.2
}
"""
# another program whose fusion.5 holds a matmul (of another type) and whose fusion.4 holds none (same type)
HLO_OTHER = """\
%fused_computation.7 (param_0: f32[8,64], param_1: f32[64,8]) -> f32[8,8] {
  %param_0 = f32[8,64]{1,0} parameter(0)
  %param_1 = f32[64,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.8 (param_0.1: f32[8,64]) -> f32[8,64] {
  %param_0.1 = f32[8,64]{1,0} parameter(0)
  ROOT %negate.1 = f32[8,64]{1,0} negate(%param_0.1)
}

ENTRY %main.2 (a: f32[8,64], b: f32[64,8]) -> f32[8,8] {
  %a = f32[8,64]{1,0} parameter(0)
  %b = f32[64,8]{1,0} parameter(1)
  %fusion.4 = f32[8,64]{1,0} fusion(%a), kind=kLoop, calls=%fused_computation.8
  ROOT %fusion.5 = f32[8,8]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_computation.7
}
"""


def test_fusions_holding_a_dot_or_convolution_are_found_in_the_hlo():
    assert xla_profile.fusions(HLO_MATMULS) == {
        "fusion.3": ("bf16[8,2736]{1,0:T(8,128)(2,1)}", True),  # a convolution in its body
        "fusion.4": ("f32[8,64]{1,0}", True),  # a dot in the fusion its body calls
        "inner": ("f32[8,64]{1,0}", True),
        "fusion.5": ("bf16[8,2736]{1,0}", False)}  # elementwise only


def test_a_fused_matmul_counts_as_a_matmul_whatever_its_name():
    index = xla_profile.FusionIndex.from_texts([HLO_MATMULS])
    event = "%fusion.3 = bf16[8,2736]{1,0:T(8,128)(2,1)} fusion(bf16[8,1024]{1,0} %x), kind=kOutput"
    short, opcode, shapes = xla_profile.parse_op(event)
    fused = index.holds_matmul(short, xla_profile.result_type(event))
    assert fused is True
    assert xla_profile.categorize(short, opcode, shapes, seq=1024, fused_matmul=fused) == "matmul"
    assert xla_profile.categorize(short, opcode, shapes, seq=1024) == "other"  # by its name alone
    assert index.holds_matmul("fusion.5") is False and index.holds_matmul("fusion.99") is None
    # a name two programs use: told apart by the result type, unknown where the type does not tell
    both = xla_profile.FusionIndex.from_texts([HLO_MATMULS, HLO_OTHER])
    assert both.modules == 2
    assert both.holds_matmul("fusion.5", "f32[8,8]{1,0}") is True
    assert both.holds_matmul("fusion.5", "bf16[8,2736]{1,0}") is False
    assert both.holds_matmul("fusion.5") is None
    assert both.holds_matmul("fusion.4", "f32[8,64]{1,0}") is None


def test_hlo_texts_are_read_from_the_modes_dump_only(tmp_path):
    old = tmp_path / "module_0001.jit_a.after_optimizations.txt"
    new = tmp_path / "module_0002.jit_b.after_optimizations.txt"
    old.write_text(HLO_OTHER)
    new.write_text(HLO_MATMULS)
    (tmp_path / "module_0002.jit_b.before_optimizations.txt").write_text("HloModule x")
    os.utime(old, (1000, 1000))
    assert xla_profile.load_hlo_texts(str(tmp_path), since=2000) == [HLO_MATMULS]
    assert len(xla_profile.load_hlo_texts(str(tmp_path))) == 2


def test_the_fastest_twin_is_the_anchor():
    def ok(step_s):
        return {"status": "ok", "median_step_s": step_s, "mfu": 0.3, "step1": {"s": 1.0}}

    modes = {"twin_xla": ok(0.10), "twin_flash": ok(0.08), "twin_splash": {"status": "failed"}, "compiled": ok(0.09),
             "fused": ok(0.12)}
    assert tpu_step.anchor(modes) == "twin_flash"
    r = tpu_step.ratios(modes)
    assert r["compiled_over_twin_tokens"] == pytest.approx(0.08 / 0.09)
    assert r["compiled_over_twin_xla_tokens"] == pytest.approx(0.10 / 0.09)
    assert r["fused_over_twin_step"] == pytest.approx(0.12 / 0.08)
    assert "twin_xla_over_twin_step" not in r
    # the old twin, kept from a run before issue #57, is measured against the new anchor, never the anchor
    kept = tpu_step.ratios({**modes, "twin": ok(0.10)})
    assert kept["old_twin_over_twin_step"] == pytest.approx(0.10 / 0.08)
    assert kept["compiled_over_twin_tokens"] == pytest.approx(0.08 / 0.09)
    # a JSON of before issue #57: its one twin is the old one
    assert tpu_step.anchor({"twin": ok(0.1), "compiled": ok(0.09)}) == "twin"
    assert tpu_step.anchor({"compiled": ok(0.09)}) is None


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
           "--modes", "twin_flash,twin_xla,fused", "--steps", "2", "--unsynced-steps", "2", "--json", str(out)]
    # Fused in chunks of its backward's graph: step 1 (AdamW's state made) is cut where step 2 is
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TPUDIST_FUSED_BACKWARD_CHUNK": "20"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["name"] == "tpu_step" and record["complete"] and record["exit_code"] == 0
    parsed = record["parsed"]
    assert set(parsed["modes"]) == {"twin_flash", "twin_xla", "fused"}
    assert parsed["anchor"] == min(("twin_flash", "twin_xla"), key=lambda k: parsed["modes"][k]["median_step_s"])
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
        # each mode's programs dumped and read: XLA:CPU fuses its dots too ("ynn_fusion"), found as matmuls
        assert mode["profile"]["hlo_modules"] >= 1 and mode["profile"]["fused_matmul_ops"] >= 1, name
        assert mode["profile"]["categories"]["matmul"]["s_per_step"] > 0
        copies = mode["profile"]["top_copies"]  # listed apart: where layout changes go
        assert all(op["category"] == "copy/transpose" for op in copies), copies
    # Fused builds its step's program in step 1 only (issue #37 item 4): step 2 builds none, counted
    assert parsed["modes"]["fused"]["step1"]["compiles"]["device_programs"] >= 1
    assert parsed["modes"]["fused"]["step2"]["compiles"]["device_programs"] == 0
    assert parsed["modes"]["fused"]["step1"]["compiles"]["device_syncs"] > 2  # the chunks ran: more programs
    assert parsed["modes"]["fused"]["settings"]["TPUDIST_FUSED_BACKWARD_CHUNK"] == "20"
    assert parsed["modes"]["twin_flash"]["settings"] == {}
    # same weights, same batch: the same first loss (bf16 rounding apart)
    assert parsed["first_loss_rel_diff_vs_twin"]["fused"] < 1e-2
    other = ({"twin_flash", "twin_xla"} - {parsed["anchor"]}).pop()
    assert parsed["first_loss_rel_diff_vs_twin"][other] < 1e-2
    assert {t["key"] for t in parsed["targets"]} == {k for k, *_ in tpu_step.TARGETS}
    assert "fused_over_twin_step" in parsed["ratios"]
    assert "summary" in record["output"]
    import report  # benchmarks/report.py renders the record as RESULTS.md's TPU section

    page = "\n".join(report.render_tpu(record))
    assert page.startswith("## On the chip: cpu") and "| JAX twin, tpudist's flash kernel |" in page
    assert "The ratios' twin (the anchor): JAX twin, " in page and "the fastest twin of the run" in page
    assert "fusions read from the HLO of" in page
    assert "| Fused with " in page and "`TPUDIST_FUSED_BACKWARD_CHUNK=20`" in page
    assert "compiled tokens/s / anchor twin tokens/s | - | >= 0.9 | n/a" in page  # no compiled run here
    # a chip's profile names what made an op (XLA:CPU's does not): the page shows it with the op
    record["parsed"]["modes"]["fused"]["profile"]["top_ops"][0]["what"] = "jit(step)/scatter-add"
    assert "(`jit(step)/scatter-add`)" in "\n".join(report.render_tpu(record))


def test_layers_compiled_apart_share_their_programs(tmp_path):
    """``--modes layers``: three layers compiled one by one are one forward graph and one backward graph,
    built in step 1, and train as the twin does (its first loss)."""
    out = tmp_path / "tpu_step.json"
    cmd = [sys.executable, os.path.join(BENCHMARKS, "tpu_step.py"), "--tiny", "--layers", "3", "--seq", "32",
           "--modes", "twin_xla,layers", "--steps", "1", "--unsynced-steps", "1", "--profile-steps", "0",
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
