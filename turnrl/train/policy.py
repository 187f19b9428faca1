"""The trained policy: model loading (full or LoRA), the reference policy, logprobs, and weight export.

- Full fine-tuning keeps fp32 master weights; the forward runs under bf16 autocast when the trainer dtype is
  `bfloat16`, or `auto` on a device with native bf16 matmuls (GPUs, CPUs with AVX512-BF16 or AMX), so matmuls
  run at bf16 speed while the optimizer stays exact; `auto` on an AVX2-only CPU trains in float32.
- LoRA (peft) trains only the adapters. The reference policy is then the same model with the adapter
  disabled, so no second copy is held in memory; with full fine-tuning it is a frozen copy.
- `logprobs` returns [B, T] aligned to token positions: column i holds log p(token_i | tokens < i) under
  softmax(logits / temperature), the same quantity the engines report (column 0 is 0).
- `export_weights` yields the tensors an engine needs after an update under the base model's parameter
  names: all weights for full fine-tuning, and for LoRA only the modules an adapter touches, merged
  (W + scale * B @ A), so the engine never needs peft.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch

from turnrl.algo.losses import entropy_from_logits, logprobs_from_logits
from turnrl.engines.cpu_attention import use_masked_sdpa
from turnrl.engines.hf import native_bf16
from turnrl.exact.model import exact_logprobs, merged_weight
from turnrl.train.fused_head import linear_logprobs
from turnrl.train.packing import Packed
from turnrl.train.shared_prefix import shared_hidden


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast for `bfloat16`, and for `auto` where the device has native bf16 matmuls (an AVX2-only CPU
    runs bf16 GEMMs in a slow fallback: `auto` trains in float32 there); None: float32."""
    if dtype == "float32" or (dtype == "auto" and not native_bf16(device)):
        return None
    return torch.bfloat16


def load_policy(model_dir: str, device: torch.device, lora_rank: int = 0, lora_alpha: float = 32.0,
                lora_dropout: float = 0.0, target_modules: list[str] | str = "all-linear",
                gradient_checkpointing: bool = False) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.config.use_cache = False
    use_masked_sdpa(model)   # CPU: grouped KV heads stay shared under masks (the shared-prefix lanes)
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                 target_modules=target_modules, task_type="CAUSAL_LM"))
        from turnrl.train.lora_fused import fuse_lora_linears
        fuse_lora_linears(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_rank > 0:
            model.enable_input_require_grads()
    model.train()
    return model


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


class Reference:
    """Reference-policy logprobs: the adapter switched off (LoRA) or a frozen copy (full fine-tuning)."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.copy = None if is_lora(policy) else copy.deepcopy(policy).eval().requires_grad_(False)

    @contextlib.contextmanager
    def model(self) -> Iterator[Any]:
        if self.copy is not None:
            yield self.copy
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return None if self.copy is None else self.copy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        if self.copy is not None and state is not None:
            self.copy.load_state_dict(state)


def forward_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, temperature: float = 1.0, amp: torch.dtype | None = None,
                     with_entropy: bool = False, entropy_grad: bool = False, fused_head: bool = False,
                     select: torch.Tensor | None = None, packed: Packed | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None, exact: torch.dtype | None = None,
                     selected: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [B, T], entropy [B, T] or None), both aligned to token positions (column 0 is 0).
    The entropy carries gradients only with `entropy_grad` (an entropy bonus); as a metric it costs none.
    `fused_head` computes the logprobs chunk by chunk from the hidden states (`turnrl.train.fused_head`)
    instead of materialising the [B, T, V] logits, and then only at the token positions `select` [B, T]
    marks (others are 0): an update needs the policy tokens' logprobs, not the prompt's or the tools'.
    `selected`, the number of True in `select[:, 1:]` where the host knows it (`Rows.host().selected`), lets
    the fused head pick those positions without a device sync.
    With `packed` (`turnrl.train.packing`, the model under `use_packed_attention`) the rows run as one packed
    row without padding; the results come back in the [B, T] layout, 0 at padding.
    With `shared` = (group, prefix) from `turnrl.train.shared_prefix.prefix_groups`, each group's shared prefix
    runs once; logprobs and entropy are then 0 inside the prefixes (no policy token lies there).
    With `exact` (engine.exact: the engine's dtype) the rows run the batch-invariant forward the engine runs
    (`turnrl.exact.model.exact_logprobs`): the logprobs equal the engine's bit for bit; `packed`, `shared`
    and `fused_head` do not apply."""
    if exact is not None:
        return exact_logprobs(model, input_ids, attention_mask, position_ids, temperature, exact, select,
                              with_entropy)
    if shared is not None and int(shared[1].max()) > 0 and select is not None \
            and causal_mask_or_none(attention_mask) is None and _output_head(model) is not None:
        lp, ent = _logprobs(model, input_ids, attention_mask, position_ids, temperature, amp, with_entropy,
                            entropy_grad, fused_head, select, {}, shared, selected)
        inside = torch.arange(input_ids.shape[1], device=lp.device)[None] <= shared[1].to(lp.device)[:, None]
        return lp.masked_fill(inside, 0.0), None if ent is None else ent.masked_fill(inside, 0.0)
    if packed is not None:
        shape = (input_ids.shape[0], input_ids.shape[1])
        if select is not None:
            select = select.clone()
            select[:, 0] = False   # a row's first token would read the previous row: its logprob is 0
        lp, ent = _logprobs(model, packed.gather(input_ids), None, packed.gather(position_ids), temperature, amp,
                            with_entropy, entropy_grad, fused_head,
                            None if select is None else packed.gather(select), packed.attention_kwargs(),
                            selected=selected)
        return packed.scatter(lp, shape), None if ent is None else packed.scatter(ent, shape)
    mask = causal_mask_or_none(attention_mask)
    if mask is None:
        position_ids = continued_positions(position_ids, attention_mask)
    return _logprobs(model, input_ids, mask, position_ids, temperature, amp, with_entropy, entropy_grad, fused_head,
                     select, {}, selected=selected)


def _logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
              temperature: float, amp: torch.dtype | None, with_entropy: bool, entropy_grad: bool, fused_head: bool,
              select: torch.Tensor | None, model_kwargs: dict[str, Any],
              shared: tuple[torch.Tensor, torch.Tensor] | None = None, selected: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    device_type = input_ids.device.type
    ctx = torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()
    temperature = 1.0 if temperature == 0.0 else temperature
    fused = fused_head and not entropy_grad
    head = _output_head(model) if fused or shared is not None else None
    hidden = None
    if head is not None:
        decoder, weight = head
        with ctx:
            hidden = (shared_hidden(decoder, input_ids, attention_mask, position_ids, *shared) if shared is not None
                      else decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False, **model_kwargs).last_hidden_state)
    if hidden is not None and fused:
        lp, ent = linear_logprobs(hidden[:, :-1], weight, input_ids[:, 1:], temperature,
                                  compute_dtype=amp or hidden.dtype,
                                  select=None if select is None else select[:, 1:].bool(), selected=selected)
        ent = ent if with_entropy else None
    else:
        with ctx:
            logits = (torch.nn.functional.linear(hidden, weight) if hidden is not None else
                      model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **model_kwargs).logits)
        logits = logits[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        lp = logprobs_from_logits(logits, input_ids[:, 1:])
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy_from_logits(logits if entropy_grad else logits.detach())
    zero = torch.zeros_like(lp[:, :1])
    lp = torch.cat([zero, lp], dim=1)
    if ent is not None:
        ent = torch.cat([zero, ent], dim=1)
    return lp, ent


def continued_positions(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Right-padded rows: the padding's position ids continue each row's count. With the 0s that ledgers put
    there, transformers reads every padding token as a packed sequence of its own and builds a dense
    [B, 1, T, T] mask, which rules out SDPA's fused causal (flash) kernel; no real token sees the padding,
    so its positions change nothing else."""
    lengths = attention_mask.sum(dim=1, keepdim=True)
    last = position_ids.gather(1, (lengths - 1).clamp(min=0))
    steps = torch.arange(position_ids.shape[1], device=position_ids.device)[None] - lengths + 1
    return torch.where(attention_mask.bool(), position_ids, last + steps)


def causal_mask_or_none(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """None when every row is right-padded (real tokens first): under a causal mask a real token never sees
    the padding after it, so no padding mask is needed and attention can take its fused causal kernel.
    Padding positions then compute junk that no loss, logprob or metric reads."""
    if bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    return attention_mask


def _output_head(model: Any) -> tuple[Any, torch.Tensor] | None:
    """(decoder, lm_head weight) of a causal LM (also under peft), or None when the head is not a plain
    bias-free linear layer (then the logits path is used)."""
    base = model.get_base_model() if is_lora(model) else model
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if get_decoder is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    return get_decoder(), head.weight


def _base_name(name: str) -> str:
    """peft parameter name -> the plain model's name."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def export_weights(model: Any, only_changed: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    if not is_lora(model):
        for name, tensor in model.state_dict().items():
            yield name, tensor.detach()
        return
    from peft.tuners.lora import LoraLayer
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and hasattr(module, "base_layer"):
            # the exact forward (engine.exact) merges with the same function, so both sides hold the same bits
            yield _base_name(name) + ".weight", merged_weight(module).detach().clone()
    if not only_changed:
        for name, tensor in model.state_dict().items():
            if "lora_" not in name and ".base_layer." not in name:
                yield _base_name(name), tensor.detach()


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def load_critic(model_dir: str, device: torch.device, lora_rank: int = 0, lora_alpha: float = 32.0,
                target_modules: list[str] | str = "all-linear") -> Any:
    """A value model for PPO: the policy's backbone with a fresh scalar head (token classification, 1 label)."""
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32).to(device)
    critic.config.use_cache = False
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model
        critic = get_peft_model(critic, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=target_modules,
                                                   task_type="TOKEN_CLS"))
        from turnrl.train.lora_fused import fuse_lora_linears
        fuse_lora_linears(critic)
    critic.train()
    return critic


def forward_values(critic: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   amp: torch.dtype | None = None) -> torch.Tensor:
    """Values [B, T] aligned like logprobs: column i is V(state before token i), read at position i - 1."""
    ctx = torch.autocast(input_ids.device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
    with ctx:
        out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    values = out[..., 0].float()[:, :-1]
    return torch.cat([torch.zeros_like(values[:, :1]), values], dim=1)


def compile_layers(model: Any, fuse_linears: bool = False) -> None:
    """torch.compile every decoder layer in place: identical layers share one compiled graph, so compiling
    costs about one layer's worth; elementwise work (norms, rotary, SwiGLU, residuals) fuses into few kernels.
    `fuse_linears`: the linears that read one input run as one GEMM (`turnrl.train.fuse_linears`)."""
    base = model.get_base_model() if is_lora(model) else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError("trainer.compile: cannot find the model's decoder layers; set trainer.compile=false")
    options = None
    if fuse_linears:
        from turnrl.train.fuse_linears import FuseParallelLinears
        options = {"pre_grad_custom_pass": FuseParallelLinears()}
    for layer in layers:
        layer.compile(dynamic=True, options=options)
