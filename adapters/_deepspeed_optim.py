"""DeepSpeed's ``optimizer`` and ``scheduler`` sections, one group each: the type names what its params mean.

DeepSpeed's "Adam" is AdamW unless ``adam_w_mode`` is false, with FusedAdam's defaults (weight decay 0); its own
optimizers (Lamb, Lion, ...) are kept for DeepSpeed; the 1-bit ones are gone in 0.19.8. Its five schedulers are
core models; any other name is a ``torch.optim.lr_scheduler`` class. The name tables are ``torsh.concepts.optim``.
"""

from __future__ import annotations

from typing import Any

from torsh import config
from torsh.concepts import optim
from torsh.config import TorshConfig
from torsh.errors import did_you_mean
from torsh.translate import WriteContext

from ._deepspeed_rules import APPROXIMATE, DEFAULTED, EXACT, UNSUPPORTED, _group, _Seen

_PARAMS = "optimizer.params"


def _read_optimizer(seen: _Seen) -> None:
    params = seen.section(_PARAMS)
    if not seen.has("optimizer.type"):
        for name in params:
            seen.drop(f"{_PARAMS}.{name}", "DeepSpeed ignores optimizer.params without optimizer.type")
        return
    name = _optimizer_name(seen, params)
    if name is None:
        return
    if name in ("Adam", "AdamW"):
        _adam_defaults(seen, name, seen.value(f"{_PARAMS}.torch_adam", False))
    for key in list(seen.section(_PARAMS)):
        _optimizer_param(seen, name, key)


def _optimizer_name(seen: _Seen, params: dict[str, Any]) -> str | None:
    """Note optimizer.type; the optimizer the engine builds (None when the type is refused)."""
    path, given = seen.items["optimizer.type"]
    lower = str(given).lower()
    if lower in optim.REMOVED_ONE_BIT:
        name = _removed_optimizer(seen, path, given, params)
    elif lower in ("adam", "adamw"):
        name = _adam(seen, lower)
    elif lower in optim.DEEPSPEED_ONLY_OPTIMIZERS:
        name = optim.DEEPSPEED_ONLY_OPTIMIZERS[lower]
        needs = " (from the mup package, which must be installed, as for DeepSpeed)" if lower.startswith("mu") \
            and lower != "muon" else ""
        seen.set("optimizer.type", "optimizer.name", name, EXACT,
                 f"built with DeepSpeed's {name} update rule{needs}")
    elif given in optim.TORCH_OPTIMIZERS or lower == "adagrad":  # DeepSpeed matches its own names case-insensitively
        name = "Adagrad" if lower == "adagrad" else given
        seen.set("optimizer.type", "optimizer.name", name, EXACT, "built as torch.optim." + name)
    else:
        hint = did_you_mean(str(given), optim.TORCH_OPTIMIZERS + tuple(optim.DEEPSPEED_ONLY_OPTIMIZERS.values()))
        seen.ctx.problem(path, given, "not a DeepSpeed optimizer or a torch.optim class (DeepSpeed asserts)", hint)
        seen.items.clear()
        return None
    return name


def _removed_optimizer(seen: _Seen, path: str, given: str, params: dict[str, Any]) -> str:
    name = optim.REMOVED_ONE_BIT[given.lower()]
    seen.drop("optimizer.type", f"{given} was removed in DeepSpeed 0.19.8 (AssertionError); replaced by {name}, "
              f"its uncompressed update rule - set optimizer.type to {name} (torch_adam: true for torch's)")
    seen.ctx.set("optimizer.name", name, path, note=False)
    for key in [k for k in params if k in optim.REMOVED_ONE_BIT_PARAMS]:
        seen.drop(f"{_PARAMS}.{key}", f"a {given} setting; {given} was removed in DeepSpeed 0.19.8")
    return name


def _adam(seen: _Seen, lower: str) -> str:
    """DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; its "AdamW" always is."""
    name = "AdamW" if lower == "adamw" or seen.value(f"{_PARAMS}.adam_w_mode", True) else "Adam"
    why = ("DeepSpeed's \"Adam\" is AdamW (decoupled weight decay) unless adam_w_mode is false"
           if lower == "adam" and name == "AdamW" else "")  # fmt: skip
    seen.set("optimizer.type", "optimizer.name", name, EXACT, why)
    if lower == "adamw":
        seen.inert(f"{_PARAMS}.adam_w_mode", "DeepSpeed ignores adam_w_mode for AdamW")
    else:
        seen.drop(f"{_PARAMS}.adam_w_mode", f"-> optimizer.name {name}", EXACT)
    return name


def _optimizer_param(seen: _Seen, name: str, key: str) -> None:
    full = f"{_PARAMS}.{key}"
    if key == "max_grad_norm":
        seen.ctx.problem(seen.items.pop(full)[0], None, "DeepSpeed rejects optimizer.params.max_grad_norm; use "
                         "the top-level gradient_clipping")  # fmt: skip
    elif key in optim.TYPED_PARAMS:
        value = seen.items[full][1]
        seen.set(full, f"optimizer.{key}", tuple(value) if isinstance(value, list) else value)
    elif key in optim.REMOVED_ONE_BIT_PARAMS:
        seen.drop(full, "a 1-bit optimizer setting; those optimizers were removed in DeepSpeed 0.19.8")
    elif key == "bias_correction" and name in ("Adam", "AdamW") and seen.value(full, True) is True:
        seen.drop(full, "torch's Adam/AdamW always correct the bias", EXACT)
    elif key == "bias_correction" and name in ("Adam", "AdamW"):
        seen.keep(full, UNSUPPORTED, "Adam without bias correction has no torch equivalent; the torsh engine "
                  "corrects the bias (kept for DeepSpeed)")  # fmt: skip
    else:
        seen.set(full, f"optimizer.kwargs.{key}", seen.items[full][1], EXACT, "passed to the constructor")


def _adam_defaults(seen: _Seen, name: str, torch_adam: bool) -> None:
    """DeepSpeed's FusedAdam defaults (weight decay 0, unlike torch's AdamW) made explicit."""
    seen.inert(f"{_PARAMS}.torch_adam", "torch's implementation instead of FusedAdam: same math (~1e-7)")
    default_wd = 0.01 if torch_adam and name == "AdamW" else optim.DEEPSPEED_ADAM["weight_decay"]
    wd_reason = ("torch.optim.AdamW's default (torch_adam: true)" if default_wd else
                 "DeepSpeed's FusedAdam default is 0 (torch's AdamW would use 0.01)")  # fmt: skip
    if not seen.has(f"{_PARAMS}.weight_decay"):
        seen.set(f"{_PARAMS}.weight_decay", "optimizer.weight_decay", None, default=default_wd, reason=wd_reason)
    for key in ("lr", "betas", "eps"):
        if not seen.has(f"{_PARAMS}.{key}"):
            seen.set(f"{_PARAMS}.{key}", f"optimizer.{key}", None, default=optim.DEEPSPEED_ADAM[key])


def _write_optimizer(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.optimizer
    if o is None:
        return
    if o.name is None:
        ctx.note("optimizer", UNSUPPORTED, "DeepSpeed uses a client optimizer as given; it cannot apply "
                 "hyper-parameters to it", o.model_dump(mode="json", exclude_defaults=True))  # fmt: skip
        return
    ctx.put("optimizer.type", o.name, "optimizer.name")
    _write_params(o, ctx)


def _write_params(o: Any, ctx: WriteContext) -> None:
    if o.name == "Adam":
        ctx.put(f"{_PARAMS}.adam_w_mode", False, "optimizer.name", EXACT,
                "DeepSpeed's Adam is AdamW unless adam_w_mode is false")  # fmt: skip
    ctx.put(f"{_PARAMS}.lr", o.lr, "optimizer.lr")
    if o.weight_decay is None and o.name in ("Adam", "AdamW", "SGD", "Adagrad"):
        ctx.put(f"{_PARAMS}.weight_decay", 0.01 if o.name == "AdamW" else 0.0, "optimizer.weight_decay",
                DEFAULTED, f"torch.optim.{o.name}'s default, written out: DeepSpeed's FusedAdam default is 0")
    for key in ("weight_decay", "betas", "eps", "momentum"):
        value = getattr(o, key)
        if value is not None:
            ctx.put(f"{_PARAMS}.{key}", list(value) if isinstance(value, tuple) else value, f"optimizer.{key}")
    for key, value in o.kwargs.items():
        ctx.put(f"{_PARAMS}.{key}", value, f"optimizer.kwargs.{key}")


OPTIMIZER = _group("optimizer", ("optimizer.type", f"{_PARAMS}.*"), ("optimizer",), _read_optimizer,
                   _write_optimizer)  # fmt: skip

# ---- scheduler -------------------------------------------------------------------------------------

_MODELS = {name: getattr(config, name) for name in optim.DEEPSPEED_SCHEDULERS}


def _read_scheduler(seen: _Seen) -> None:
    params = seen.section("scheduler.params")
    if not seen.has("scheduler.type"):
        for name in params:
            seen.drop(f"scheduler.params.{name}", "DeepSpeed ignores scheduler.params without scheduler.type")
        return
    given = seen.items["scheduler.type"][1]
    model = _MODELS.get(given)
    if model is None:
        seen.set("scheduler.type", "scheduler.name", given, EXACT, f"torch.optim.lr_scheduler.{given}")
        for key in params:
            seen.set(f"scheduler.params.{key}", f"scheduler.kwargs.{key}", params[key][1])
        return
    seen.set("scheduler.type", "scheduler.name", given)
    fields = [f for f in model.model_fields if f != "name"]
    for key in params:
        _scheduler_extra(seen, given, key, fields)
    for key in fields:
        _scheduler_field(seen, given, key, model.model_fields[key])


def _scheduler_extra(seen: _Seen, given: str, key: str, fields: list[str]) -> None:
    """A scheduler parameter that is no argument of the scheduler."""
    if key == "last_batch_iteration":
        seen.inert(f"scheduler.params.{key}", "a resume offset; torsh restores the scheduler from the checkpoint")
    elif key not in fields:
        hint = did_you_mean(key, fields)
        seen.drop(f"scheduler.params.{key}", f"not a {given} argument (DeepSpeed fails when it builds the "
                  "scheduler)" + (f"; did you mean '{hint}'?" if hint else ""))  # fmt: skip


def _scheduler_field(seen: _Seen, given: str, key: str, field: Any) -> None:
    full = f"scheduler.params.{key}"
    if key == "warmup_type" and seen.has(full) and seen.value(full) not in ("log", "linear"):
        seen.set(full, "scheduler.warmup_type", "log", APPROXIMATE, "unknown type: DeepSpeed warns and uses log")
    elif seen.has(full):
        seen.set(full, f"scheduler.{key}", seen.items[full][1])
    elif field.is_required():
        seen.ctx.problem(full, None, f"{given} needs {key} (DeepSpeed fails when it builds the scheduler)")
    else:
        seen.set(full, f"scheduler.{key}", None, default=field.default,
                 reason="DeepSpeed default: each parameter group's lr" if field.default is None else "")


def _write_scheduler(cfg: TorshConfig, ctx: WriteContext) -> None:
    s = cfg.scheduler
    if s is None:
        return
    ctx.put("scheduler.type", s.name, "scheduler.name")
    if s.name in _MODELS:  # one of DeepSpeed's own: its fields are its params
        for key, value in s:
            if key != "name" and value is not None:
                ctx.put(f"scheduler.params.{key}", value, f"scheduler.{key}")
    else:
        for key, value in s.kwargs.items():
            ctx.put(f"scheduler.params.{key}", value, f"scheduler.kwargs.{key}")


SCHEDULER = _group("scheduler", ("scheduler.type", "scheduler.params.*"), ("scheduler",), _read_scheduler,
                   _write_scheduler)  # fmt: skip
