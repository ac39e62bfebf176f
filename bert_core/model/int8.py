"""Dynamic int8 models for CPU inference: the Linear layers' weights in int8, on disk and in use.

Why this form (measured in docs/compress.md, against ONNX Runtime's dynamic quantization): the
weights of every `nn.Linear` (q/k/v, attention output, feed-forward, pooler, head) are int8 with
one scale per output row (symmetric, per channel: closer to fp32 than one scale per matrix at no
cost in speed), and each layer quantises its input on the fly (torch's dynamic quantization,
FBGEMM kernels). q, k and v run as one int8 GEMM (`Int8SelfAttention`), as the fp32 model runs
them as one fp32 GEMM. Embeddings are lookups, cheap in fp32, but half of a small BERT's weights
(MiniLM: 11.7 M of 22.7 M, the vocabulary's rows): they are stored int8 per row and turned back
into fp32 when loaded, so the file is a quarter of the fp32 one and LayerNorm stays fp32.

On disk a quantized model is an ordinary model folder: config.json (with `quantization`, the
method and where the weights came from), `model.safetensors` holding int8 `<linear>.weight`
tensors beside their fp32 `<linear>.weight_scale` and biases (no pickle, and the size on disk is
really a quarter), the vocab and tokenizer files. `BertPreTrainedModel.from_pretrained` loads
it (`load`), so every loader (`bert predict`, `bert serve`, the MLflow model, `bert embed`) reads
it; training from it is refused (`check_trainable`). The int8 kernels are CPU kernels: `device`
picks the CPU for "auto" and refuses any other device by name.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized import dynamic as qd

from bert_core.errors import BertError, InputError, atomic_dir
from bert_core.model.config import (
    CONFIG_NAME,
    TOKENIZER_FILES,
    VOCAB_NAME,
    WEIGHTS_NAME,
    BertConfig,
)
from bert_core.model.layers import BertSelfAttention

KEY = "quantization"  # config.json's field that says a folder is an int8 model
METHOD = "torch-dynamic-int8"  # int8 per-channel weights, activations quantised per call


class Int8SelfAttention(nn.Module):
    """`BertSelfAttention` with q, k and v as one int8 Linear `qkv` (3H outputs)."""

    def __init__(self, qkv: nn.Module, n_head: int):
        super().__init__()
        self.qkv, self.n_head = qkv, n_head

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_head, H // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2).reshape(B, L, H)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor):
    """A dynamic int8 Linear from fp32 `weight` [out, in] and per-row `scale` [out]."""
    zero = torch.zeros(weight.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # deprecated in torch 2.13: docs/compress.md
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
        q = torch.quantize_per_channel(weight.float(), scale.double(), zero, 0, torch.qint8)
    layer = qd.Linear(weight.shape[1], weight.shape[0], bias_=bias is not None, dtype=torch.qint8)
    layer.set_weight_bias(q, None if bias is None else bias.float())
    return layer


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row scales: each row's largest |w| maps to 127."""
    return (weight.detach().abs().amax(dim=1).float() / 127).clamp(min=1e-12)


def _swap(model: nn.Module, make) -> None:
    """q/k/v -> one `qkv` Linear per attention, then every Linear -> `make(name, linear)`."""
    for name, module in list(model.named_modules()):
        if isinstance(module, BertSelfAttention):
            qkv = nn.Linear(module.query.in_features, 3 * module.query.out_features)
            with torch.no_grad():
                qkv.weight.copy_(
                    torch.cat([module.query.weight, module.key.weight, module.value.weight])
                )
                qkv.bias.copy_(torch.cat([module.query.bias, module.key.bias, module.value.bias]))
            _set(model, name, Int8SelfAttention(qkv, module.n_head))
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            _set(model, name, make(name, module))


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize(model: nn.Module) -> nn.Module:
    """The fp32 `model` (a `BertPreTrainedModel`) as an int8 one, in place, in eval mode."""
    model = model.cpu().eval()
    _swap(model, lambda _, lin: int8_linear(lin.weight, lin.bias, row_scales(lin.weight)))
    return model


def int8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors saved: int8 weights and their scales per int8 Linear, the rest as it is."""
    state: dict[str, torch.Tensor] = {}
    for name, module in _int8_linears(model).items():
        weight, bias = module._packed_params._weight_bias()
        state[f"{name}.weight"] = weight.int_repr().contiguous()
        state[f"{name}.weight_scale"] = weight.q_per_channel_scales().float()
        if bias is not None:
            state[f"{name}.bias"] = bias.detach().float()
    for name, module in model.named_modules():  # int8 on disk only: fp32 again once loaded
        if isinstance(module, nn.Embedding):
            scale = row_scales(module.weight)
            state[f"{name}.weight"] = (
                (module.weight.detach() / scale[:, None]).round().to(torch.int8)
            )
            state[f"{name}.weight_scale"] = scale
    return {k: v.detach().contiguous() for k, v in _fp32_state(model).items()} | state


def _int8_linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, qd.Linear)}


def _fp32_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state of everything but the int8 Linears (embeddings, LayerNorm): plain tensors."""
    int8 = tuple(f"{n}." for n in _int8_linears(model))
    return {k: v for k, v in model.state_dict().items() if not k.startswith(int8)}


def save(model: nn.Module, model_dir: str | Path, info: dict, config: dict) -> None:
    """Write an int8 `model` as a model folder (atomically): `config` (the source's
    config.json) with `quantization` = `info`, the int8 safetensors, the tokenizer files of
    the model's `vocab_file`."""
    import shutil

    from safetensors.torch import save as to_bytes

    vocab = getattr(model, "vocab_file", None)
    with atomic_dir(model_dir) as tmp:
        config = {**config, KEY: {"method": METHOD, **info}}
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        tensors = to_bytes(int8_state(model), metadata={"format": "pt", KEY: METHOD})
        (tmp / WEIGHTS_NAME).write_bytes(tensors)
        if vocab is not None:
            for name in TOKENIZER_FILES:
                if (Path(vocab).parent / name).is_file():
                    shutil.copyfile(Path(vocab).parent / name, tmp / name)


def quantization(model_dir: str | Path) -> dict | None:
    """config.json's `quantization` (an int8 model), or None (fp32, or no readable config)."""
    try:
        config = json.loads((Path(model_dir) / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get(KEY) if isinstance(config, dict) else None


def load(cls: type[nn.Module], model_dir: str | Path) -> nn.Module:
    """An int8 model folder (`save`'s) as `cls` (a head class, or `BertModel` for its encoder),
    int8 Linears in place, ready for CPU inference. A missing or extra tensor is an error
    naming it, as for fp32 checkpoints."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    if (method := (quantization(model_dir) or {}).get("method")) != METHOD:
        raise InputError(
            model_dir / CONFIG_NAME,
            f"quantization method {method!r} is unknown (this version reads {METHOD!r})",
        )
    try:
        state = load_file(model_dir / WEIGHTS_NAME)
    except (SafetensorError, OSError) as e:
        raise InputError(model_dir / WEIGHTS_NAME, f"not a readable int8 model ({e})") from None
    model = cls(BertConfig.from_json_file(model_dir / CONFIG_NAME), init_weights=False).eval()
    prefix = model.base_model_prefix + "."
    if not hasattr(model, model.base_model_prefix):  # the encoder alone: drop the head
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

    def make(name: str, lin: nn.Linear) -> nn.Module:
        try:
            weight, scale = state.pop(f"{name}.weight"), state.pop(f"{name}.weight_scale")
        except KeyError:
            raise InputError(model_dir / WEIGHTS_NAME, f"no int8 weight for {name}") from None
        return int8_linear(weight.float() * scale[:, None], state.pop(f"{name}.bias", None), scale)

    _swap(model, make)
    for key in [k for k in state if k.endswith(".weight_scale")]:  # the embeddings
        weight = key.removesuffix("_scale")
        state[weight] = state[weight].float() * state.pop(key)[:, None]
    own = _fp32_state(model)
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise InputError(
            model_dir / WEIGHTS_NAME,
            f"does not match {cls.__name__}: missing {missing[:10]}, unexpected {unexpected[:10]}",
        )
    with torch.no_grad():
        for key, tensor in own.items():
            tensor.copy_(state[key])
    if (model_dir / VOCAB_NAME).is_file():
        model.vocab_file = model_dir / VOCAB_NAME
    return model


def device(model_dir: str | Path, requested: str) -> torch.device | None:
    """Where an int8 model runs: the CPU for "auto" and "cpu", any other device refused (the
    int8 kernels are CPU kernels); None for an fp32 model (the caller's usual choice)."""
    if quantization(model_dir) is None:
        return None
    if requested not in ("auto", "cpu"):
        raise BertError(
            f"{model_dir}: an int8 model (`bert quantize`) runs on the CPU only, not --device "
            f"{requested}; use --device cpu, or the fp32 model"
        )
    return torch.device("cpu")


def check_trainable(model_dir: str | Path) -> None:
    """Refuse to train from an int8 model: its weights are rounded and frozen into int8."""
    if quantization(model_dir) is not None:
        raise InputError(
            Path(model_dir) / CONFIG_NAME,
            "an int8 model (`bert quantize`) is for inference only; fine-tune from the fp32 "
            "model it was made from",
        )
