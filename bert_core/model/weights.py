"""A model folder's weights as tensors: read (safetensors, or a legacy pickle of tensors only)
and checked to be finite. Every loader reads them here (`BertPreTrainedModel.from_pretrained`),
and `save_pretrained` refuses to write what `nonfinite` names.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bert_core.errors import InputError, NotFound
from bert_core.model import int8
from bert_core.model.config import LEGACY_WEIGHTS_NAME, WEIGHTS_NAME


def nonfinite(state: dict[str, torch.Tensor]) -> str | None:
    """The first floating-point tensor holding a NaN or an infinity, by name; None when none.
    Such weights come from a diverged training: every prediction from them is NaN (or the class
    argmax picks over NaN), so no command loads them and none writes them."""
    for name, tensor in state.items():  # an int8 model's state also holds dtypes and tuples
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            if not bool(torch.isfinite(tensor).all()):
                return name
    return None


def check_finite(state: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """`state`, or an error naming `file` and the first non-finite tensor in it."""
    if (name := nonfinite(state)) is not None:
        raise InputError(
            file, f"weight {name} holds NaN or infinite values (a diverged training?): not loaded"
        )
    return state


def read(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a model folder: model.safetensors, else a legacy pytorch_model.bin.

    A damaged file is an error naming it, never a library traceback; a pickle that holds more
    than tensors is refused (`weights_only`: a checkpoint from the internet must not run code),
    and so is an int8 model (`int8.check_trainable`: its weights are not for training) and one
    whose weights are not finite (`check_finite`).
    """
    int8.check_trainable(model_dir)
    if (model_dir / WEIGHTS_NAME).is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(model_dir / WEIGHTS_NAME)
        except (SafetensorError, OSError) as e:
            raise InputError(
                model_dir / WEIGHTS_NAME, f"not a readable safetensors file ({e})"
            ) from None
        return check_finite(state, model_dir / WEIGHTS_NAME)
    if (model_dir / LEGACY_WEIGHTS_NAME).is_file():
        import pickle

        try:
            state = torch.load(
                model_dir / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True
            )
        except pickle.UnpicklingError:
            raise InputError(
                model_dir / LEGACY_WEIGHTS_NAME,
                "holds objects other than tensors, which are not loaded (they could run code); "
                "convert it to model.safetensors where you trust it, e.g. with transformers' "
                "`from_pretrained(...).save_pretrained(..., safe_serialization=True)`",
            ) from None
        except (RuntimeError, EOFError, OSError) as e:
            raise InputError(
                model_dir / LEGACY_WEIGHTS_NAME, f"not a readable checkpoint ({e})"
            ) from None
        return check_finite(state, model_dir / LEGACY_WEIGHTS_NAME)
    raise NotFound(f"{model_dir}: no {WEIGHTS_NAME} or {LEGACY_WEIGHTS_NAME}")
