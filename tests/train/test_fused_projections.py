"""Fused q/k/v and gate/up projections (`trainer.fused_projections`): the rotary and SwiGLU kernels against eager
torch on the CPU through Triton's interpreter (the same bits), a packed Llama-shaped model's logits and gradients
against its own layers, which modules are taken, the config's checks; on a GPU against the compiled layer."""

import importlib.util
import json

import pytest
import torch

from turnrl.bench.train import SHAPES
from turnrl.cli import main
from turnrl.config import ConfigError, load_config
from turnrl.train import fused_projections as fp

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (its interpreter runs on the CPU)")


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def eager_rotary(y, cos, sin, heads, kv):
    """transformers' q/k/v split and apply_rotary_pos_emb, in eager torch on y [T, (H + 2 KV) D]."""
    t = y.shape[0]
    dim = cos.shape[-1]
    q, k, v = y.split([heads * dim, kv * dim, kv * dim], dim=-1)
    q, k, v = q.view(t, heads, dim), k.view(t, kv, dim), v.view(t, kv, dim)
    c, s = cos[:, None], sin[:, None]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v


def angles(t, dim, dtype, seed=0):
    """cos, sin [T, D] as transformers' rotary embedding builds them (both halves alike), in `dtype`."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = (torch.arange(t).float() + 3 * seed)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@needs_triton
@pytest.mark.parametrize("heads,kv,dim,t", [(4, 2, 16, 70), (7, 1, 32, 129)])
@pytest.mark.parametrize("blocking", [fp.ROTARY, (128, 8, True)])
def test_rotary_split_and_merge_give_eager_bits(interpreted, monkeypatch, heads, kv, dim, t, blocking):
    """bf16: q, k, v equal eager transformers' rotary, and rotary_merge equals autograd's gradient of it, bit for
    bit (a partial token block included), whichever blocking and grid order the launch takes."""
    monkeypatch.setattr(fp, "ROTARY", blocking)
    g = torch.Generator().manual_seed(heads)
    y = torch.randn(t, (heads + 2 * kv) * dim, generator=g).bfloat16()
    cos, sin = angles(t, dim, torch.bfloat16)
    got = fp.rotary_split(y, cos, sin, heads, kv)
    leaf = y.clone().requires_grad_()
    want = eager_rotary(leaf, cos, sin, heads, kv)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b.detach())
    grads = [torch.randn(w.shape, generator=g).bfloat16() for w in want]
    torch.autograd.backward(want, grads)
    assert torch.equal(fp.rotary_merge(*grads, cos, sin), leaf.grad)


@needs_triton
def test_swiglu_and_its_gradient_follow_eager(interpreted):
    """bf16: h = silu(g) * u and (dg | du) as eager torch rounds them, within one bf16 step where SiLU's float32
    formula differs in the last bit."""
    g = torch.Generator().manual_seed(1)
    t, n = 37, 300   # a partial column block
    y = torch.randn(t, 2 * n, generator=g).bfloat16()
    h = fp.swiglu(y)
    leaf = y.clone().requires_grad_()
    gate, up = leaf.split([n, n], dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert (h != want).float().mean() < 0.01
    assert torch.allclose(h.float(), want.detach().float(), rtol=2 ** -7, atol=0)
    dh = torch.randn(t, n, generator=g).bfloat16()
    want.backward(dh)
    dy = fp.swiglu_back(dh, y)
    assert dy.shape == (t, 2 * n)
    assert (dy != leaf.grad).float().mean() < 0.01
    assert torch.allclose(dy.float(), leaf.grad.float(), rtol=2 ** -6, atol=1e-6)


def test_bad_rotary_inputs_are_refused():
    with pytest.raises(ValueError, match=r"\[T, \(H \+ 2 KV\) D\]"):
        fp.rotary_split(torch.zeros(5, 100), torch.zeros(5, 16), torch.zeros(5, 16), 4, 2)
    with pytest.raises(ValueError, match="partial rotary"):
        fp.rotary_split(torch.zeros(5, 128), torch.zeros(5, 8), torch.zeros(5, 8), 4, 2)


def tiny_model(dtype=torch.bfloat16, seed=0, model_type="llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    shape = {**SHAPES["tiny-shape"], "model_type": model_type}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).to(dtype)


@needs_triton
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])   # qwen2: q, k, v with biases
def test_a_packed_compiled_model_runs_fused(interpreted, monkeypatch, model_type):
    """A bf16 Llama- or Qwen2-shaped model under turnrl's packed Triton attention, its layers compiled (fullgraph):
    with the fused projections the logits and gradients match its own layers within bf16 noise, and the custom ops
    ran."""
    from turnrl.train.packing import pack, use_packed_attention

    monkeypatch.setattr(fp, "_INTERPRET", True)
    model = tiny_model(model_type=model_type)
    assert use_packed_attention(model, "triton") == "triton"
    lengths = torch.tensor([23, 9, 40])
    packed = pack(lengths, torch.device("cpu"))
    ids = torch.randint(0, 1024, (1, packed.length))
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()] +
                          [torch.arange(packed.length - int(lengths.sum()))])[None]
    kwargs = packed.attention_kwargs()

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).logits.float()
        logits.logsumexp(-1).sum().backward()
        layer = model.model.layers[0]
        attn = layer.self_attn
        return (logits.detach(), attn.k_proj.weight.grad.float(), layer.mlp.up_proj.weight.grad.float(),
                model.model.embed_tokens.weight.grad.float()) + \
            ((attn.q_proj.bias.grad.float(),) if attn.q_proj.bias is not None else ())

    plain = with_triton_attention(run)
    assert fp.use_fused_projections(model) == {"attention": 2, "mlp": 2}
    calls = {}
    for name in ("rotary_split", "rotary_merge", "swiglu", "swiglu_back"):
        def counted(*args, _name=name, _fn=getattr(fp, name)):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args)
        monkeypatch.setattr(fp, name, counted)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    got = run()
    assert calls == {"rotary_split": 2, "rotary_merge": 2, "swiglu": 2, "swiglu_back": 2}
    assert len(got) == (5 if model_type == "qwen2" else 4)
    for a, b in zip(got, plain):
        assert (a - b).abs().max() <= 0.05 * b.abs().max()


def test_which_modules_it_takes():
    """Llama's attention and MLP; on float32 CPU tensors the modules' own forward runs (the same logits); a GELU
    MLP, per-head norms, a sliding window or LoRA-wrapped projections are left alone."""
    model = tiny_model(torch.float32)
    ids = torch.randint(0, 1024, (1, 9))
    want = model(input_ids=ids).logits
    layer = model.model.layers[0]
    assert fp.use_fused_projections(model) == {"attention": 2, "mlp": 2}
    assert fp.use_fused_projections(model) == {"attention": 2, "mlp": 2}   # switched once, however often called
    assert layer.self_attn.forward.__func__ is fp._fused_attention and layer.mlp.forward.__func__ is fp._fused_mlp
    assert torch.equal(model(input_ids=ids).logits, want)
    layer.mlp.act_fn = torch.nn.GELU()
    assert not fp.plain_swiglu(layer.mlp)
    layer.self_attn.q_norm = torch.nn.Identity()
    assert not fp.attention_fusable(layer.self_attn)
    del layer.self_attn.q_norm
    layer.self_attn.sliding_window = 4096
    assert not fp.attention_fusable(layer.self_attn)
    from peft import LoraConfig, get_peft_model
    lora = get_peft_model(tiny_model(torch.float32), LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match="fused_projections to auto or off"):
        fp.use_fused_projections(lora)
    assert fp.use_fused_projections(lora, required=False) == {"attention": 0, "mlp": 0}   # auto: left alone


def test_auto_switches_where_the_kernels_run():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fp.projections_wanted("auto", cuda, torch.bfloat16, False, False)
    assert fp.projections_wanted("auto", cuda, torch.float16, False, False)
    assert not fp.projections_wanted("auto", cpu, torch.bfloat16, False, False)
    assert not fp.projections_wanted("auto", cuda, torch.float32, False, False)   # fp32 weights under autocast
    assert not fp.projections_wanted("auto", cuda, torch.bfloat16, True, False)   # engine.exact
    assert not fp.projections_wanted("auto", cuda, torch.bfloat16, False, True)   # fused_mlp takes the MLPs
    assert fp.projections_wanted("on", cpu, torch.float32, False, False)         # then use_fused_projections checks
    assert not fp.projections_wanted("off", cuda, torch.bfloat16, False, False)


def test_the_trainer_switches_by_the_key():
    """`use_fused_modules` as the trainer and the bench call it: auto leaves a CPU model alone and on switches
    it; auto on a CUDA device with bf16 weights switches (the device is only named here: nothing runs on it)."""
    from turnrl.train.trainer import use_fused_modules

    def switched(overrides, device="cpu"):
        model = tiny_model(torch.float32)
        return use_fused_modules(model, load_config(None, overrides), torch.device(device), None)

    assert load_config(None, []).trainer.fused_projections == "auto"
    assert switched([]) == {"fused_mlps": 0, "fused_projections": {}}
    assert switched(["trainer.fused_projections=on"])["fused_projections"] == {"attention": 2, "mlp": 2}
    assert switched(["trainer.fused_projections=off"], "cuda")["fused_projections"] == {}
    assert switched([], "cuda")["fused_projections"] == {"attention": 2, "mlp": 2}
    assert switched(["trainer.param_dtype=float32"], "cuda")["fused_projections"] == {}


@pytest.mark.parametrize("key,on", [("fused_projections", "on"), ("fused_mlp", True)])
def test_the_config_keys_and_their_limits(key, on):
    assert getattr(load_config(None, [f"trainer.{key}=true"]).trainer, key) == on   # YAML true is on
    with pytest.raises(ConfigError, match=key):
        load_config(None, [f"trainer.{key}=true", "trainer.placement=split"])
    from turnrl.train.trainer import exact_dtype
    cfg = load_config(None, [f"trainer.{key}=true", "engine.exact=true", "rollout.sampling.top_p=1"])
    with pytest.raises(ValueError, match=f"{key}=false"):
        exact_dtype(cfg, torch.device("cpu"))


def test_auto_gives_way_where_on_is_an_error():
    """fused_projections auto with fused_mlp, split placement or engine.exact: no error (it stays off there);
    on: each is an error that names the fix."""
    from turnrl.train.trainer import exact_dtype
    with pytest.raises(ConfigError, match="set 'fused_projections' to auto or off, or 'fused_mlp' to false"):
        load_config(None, ["trainer.fused_projections=on", "trainer.fused_mlp=true"])
    assert load_config(None, ["trainer.fused_mlp=true"]).trainer.fused_projections == "auto"
    assert load_config(None, ["trainer.placement=split"]).trainer.fused_projections == "auto"
    cfg = load_config(None, ["engine.exact=true", "rollout.sampling.top_p=1"])
    assert exact_dtype(cfg, torch.device("cpu")) is not None
    with pytest.raises(ConfigError, match="must be one of 'auto', 'on', 'off'"):
        load_config(None, ["trainer.fused_projections=yes please"])


@pytest.mark.parametrize("key,field,fused", [("fused_projections", "fused_projections", {"attention": 2, "mlp": 2}),
                                             ("fused_mlp", "fused_mlps", 2)])
def test_bench_train_reports_what_it_fused(tmp_path, key, field, fused):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--model", "tiny-shape", "--batch", "2", "--seq-len", "16", "--steps", "1",
                 "--repeats", "1", "--lora-rank", "0", "--json", str(out), f"trainer.{key}=true"]) == 0
    report = json.loads(out.read_text())
    assert report[field] == fused and report["config"]["trainer"][key] in (True, "on")


def with_triton_attention(run):
    """`run` with the model's own layers, their packed attention through turnrl's Triton kernel as on a GPU (on
    CPU tensors `packing.packed_attention` takes SDPA): the reference differs from the fused run only in the
    projections."""
    import functools

    from transformers import AttentionInterface

    from turnrl.train import flash_kernel
    from turnrl.train.packing import ATTENTION, packed_attention

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        out = flash_kernel.packed_attention(q, k, v, kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]), scaling)
        return out.unsqueeze(0), None

    AttentionInterface.register(f"{ATTENTION}_triton", attention)
    try:
        return run()
    finally:
        AttentionInterface.register(f"{ATTENTION}_triton", functools.partial(packed_attention, kernel="triton"))


def error(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_it_is_as_close_to_float32_as_the_compiled_layers():
    """Two Qwen2.5-0.5B-shaped layers, three packed rows (4,100 tokens), bf16 weights, layers compiled by inductor:
    logits and gradients with the fused projections as close to the float32 model's as the compiled layers'
    own, and two runs give the same bits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from turnrl.train.packing import pack, use_packed_attention

    shape = {**SHAPES["qwen2.5-0.5b-shape"], "num_hidden_layers": 2}
    lengths = torch.tensor([1500, 900, 1700])
    packed = pack(lengths, torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (1, packed.length), generator=g).cuda()
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()] +
                          [torch.arange(packed.length - int(lengths.sum()))])[None].cuda()

    def build(dtype, fused):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).to("cuda", dtype)
        use_packed_attention(model, "triton")
        if fused:
            assert fp.use_fused_projections(model) == {"attention": 2, "mlp": 2}
        if dtype != torch.float32:
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        return model

    def run(model):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, **packed.attention_kwargs()).logits
        (logits.float().logsumexp(-1).sum() / 1000).backward()
        layer = model.model.layers[1]
        return [logits.detach()] + [p.grad for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.bias,
                                                     layer.self_attn.v_proj.weight, layer.mlp.gate_proj.weight,
                                                     layer.mlp.up_proj.weight, model.model.embed_tokens.weight)]

    want = run(build(torch.float32, False))
    plain = run(build(torch.bfloat16, False))
    fused_model = build(torch.bfloat16, True)
    got = run(fused_model)
    for a, b, ref in zip(got, plain, want):
        assert error(a, ref) < max(1.5 * error(b, ref), 2 ** -9)
    for a, b in zip(run(fused_model), got):
        assert torch.equal(a, b)
