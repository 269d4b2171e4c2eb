"""How the parameters move each step, beyond the optimizer's kind: the learning-rate schedule,
weight decay by parameter, gradient clipping's factor, SGD's momentum and AdamW's betas.

``train.py``, the single-process reference (`autopart.runtime.reference`) and ``autopart verify``
all read one `Recipe`, so that the distributed programs and the original model are updated by the
same arithmetic: a schedule is a function of the step alone, a parameter's decay a function of its
name and shape alone, and the clipping factor a function of the global gradient norm alone.

Weight decay, the rule: a parameter is decayed when it has two or more dimensions and is not an
embedding table (a weight of an ``nn.Embedding`` or ``nn.EmbeddingBag``, under every name it has,
so a language-model head tied to the token embedding is not decayed either). Biases and the weights
of norms are 1-D, so none of them is decayed: what most LLM recipes do (nanoGPT, torchtitan, the
Llama and GPT-3 papers). The embedding names are found at compile time from the model's modules
and kept in ``plan.embedding_parameters``: a stage module no longer holds ``nn.Embedding``.
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from autopart.ir.errors import ConfigError

__all__ = ["LR_SCHEDULES", "Recipe", "add_recipe_arguments", "betas_flag", "embedding_parameters", "decayed_parameters",
           "parameter_groups"]

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The train.py flags that decide an update beyond ``--optimizer`` and ``--lr``."""

    lr_schedule: str = "constant"
    """``constant``, ``cosine`` or ``linear``: how the rate falls from ``--lr`` to ``min_lr`` after warmup."""
    warmup_steps: int = 0
    """Steps over which the rate rises linearly, ``lr * (s + 1) / (warmup + 1)`` at step s (nanoGPT's ramp)."""
    min_lr: float = 0.0
    """The rate that cosine and linear decay reach at the last step."""
    clip_grad_norm: float | None = None
    """Scale every gradient by ``min(1, X / (norm + 1e-6))``, the norm over the whole model (as
    ``torch.nn.utils.clip_grad_norm_``); None: no clipping."""
    weight_decay: float | None = None
    """Decay of the decayed parameters (module docstring), as each torch optimizer takes it: AdamW's
    decoupled from the gradient, SGD's an L2 term added to it (which its momentum then carries);
    None: the optimizer's default (AdamW 0.01, SGD 0). The others are never decayed."""
    momentum: float = 0.0
    """SGD's momentum (``torch.optim.SGD``'s, dampening 0): its buffer is optimizer state, kept by
    checkpoints and sharded as AdamW's moments are. 0: plain SGD."""
    nesterov: bool = False
    """SGD's Nesterov momentum (needs a ``momentum`` above 0)."""
    betas: tuple[float, float] | None = None
    """AdamW's decay rates of its moments (``torch.optim.AdamW``'s ``betas``); None: torch's (0.9, 0.999)."""

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown --lr-schedule {self.lr_schedule!r}; use one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be at least 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr < math.inf:  # NaN too
            raise ConfigError(f"--min-lr must be a finite rate, at least 0, got {self.min_lr:g}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"--clip-grad-norm must be a positive norm, got {self.clip_grad_norm:g}")
        if self.weight_decay is not None and not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"--weight-decay must be finite, at least 0, got {self.weight_decay:g}")
        if not 0 <= self.momentum < math.inf:
            raise ConfigError(f"--momentum must be finite, at least 0, got {self.momentum:g}")
        if self.nesterov and not self.momentum > 0:
            raise ConfigError("--nesterov is a kind of momentum: give --momentum above 0 too (0.9 is usual)")
        if self.betas is not None and not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"--betas must be two rates in [0, 1), got {','.join(f'{b:g}' for b in self.betas)}")

    def check(self, *, lr: float, optimizer: str) -> None:
        """`check_lr`, and refuse SGD's momentum or AdamW's betas given to the other optimizer, which
        would ignore them unsaid."""
        self.check_lr(lr)
        if optimizer != "adamw" and self.betas is not None:
            raise ConfigError(f"--betas are AdamW's, and --optimizer is {optimizer}; drop --betas, or give "
                              "--optimizer adamw")
        if optimizer != "sgd" and (self.momentum or self.nesterov):
            flag = "--momentum" if self.momentum else "--nesterov"
            raise ConfigError(f"{flag} is SGD's, and --optimizer is {optimizer}, whose first moment is its own; drop "
                              f"{flag}, or give --optimizer sgd")

    def check_lr(self, lr: float) -> None:
        """Refuse a rate that torch's optimizers would refuse with a traceback on every rank (NaN),
        that would make every weight infinite (inf), or that this schedule would raise as it goes
        (a ``min_lr`` above it)."""
        if not 0 <= lr < math.inf:
            raise ConfigError(f"--lr must be a finite learning rate, at least 0, got {lr:g}")
        if self.lr_schedule != "constant" and self.min_lr > lr:
            raise ConfigError(f"--min-lr {self.min_lr:g} is above --lr {lr:g}, so --lr-schedule {self.lr_schedule} "
                              "would raise the rate as it goes; give a --min-lr below --lr")

    @staticmethod
    def from_args(args: argparse.Namespace) -> Recipe:
        """The recipe of the flags of `add_recipe_arguments`; raises ConfigError for values out of range."""
        return Recipe(lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                      clip_grad_norm=args.clip_grad_norm, weight_decay=args.weight_decay, momentum=args.momentum,
                      nesterov=args.nesterov, betas=args.betas)

    def optimizer_options(self) -> dict:
        """The keyword arguments of `autopart.runtime.optim.make_optimizer` that this recipe sets."""
        return {"momentum": self.momentum, "nesterov": self.nesterov, "betas": self.betas}

    def train_args(self) -> list[str]:
        """The train.py flags that give this recipe (for ``autopart verify`` and tests)."""
        args = ["--lr-schedule", self.lr_schedule, "--warmup-steps", str(self.warmup_steps)]
        args += ["--min-lr", repr(self.min_lr)]
        if self.clip_grad_norm is not None:
            args += ["--clip-grad-norm", repr(self.clip_grad_norm)]
        if self.weight_decay is not None:
            args += ["--weight-decay", repr(self.weight_decay)]
        if self.momentum:
            args += ["--momentum", repr(self.momentum)]
        if self.betas is not None:
            args += ["--betas", ",".join(map(repr, self.betas))]
        return args + (["--nesterov"] if self.nesterov else [])

    def flags(self, lr: float, steps: int) -> dict[str, str]:
        """The train.py flags of this recipe over a run of ``steps`` at ``lr`` (the steps only
        where the rate decays by the last one): what a checkpoint records, so that a resume with
        other ones is told."""
        recipe = [arg for arg in self.train_args() if arg != "--nesterov"]
        steps_flag = {} if self.lr_schedule == "constant" else {"--steps": str(steps)}
        nesterov = {"--nesterov": "given"} if self.nesterov else {}
        return {**steps_flag, "--lr": repr(lr), **dict(zip(recipe[::2], recipe[1::2])), **nesterov}

    @staticmethod
    def changed_flags(saved: dict[str, str], now: dict[str, str]) -> list[str]:
        """The recipe flags a resumed run gives otherwise than the run that saved its checkpoint
        (both `flags`), as "FLAG SAVED (now NOW)". ``--steps`` is recorded only under a decaying
        schedule, so it is compared only where both runs recorded it: a change of schedule is told
        by ``--lr-schedule`` itself."""
        flags = sorted(saved.keys() | now.keys())
        if not ("--steps" in saved and "--steps" in now):
            flags = [f for f in flags if f != "--steps"]
        return [f"{flag} {saved.get(flag, '(not given)')} (now {now.get(flag, '(not given)')})"
                for flag in flags if saved.get(flag) != now.get(flag)]

    def lr_factor(self, lr: float, steps: int) -> Callable[[int], float]:
        """The multiplier of ``lr`` at each step (0-based), for ``torch.optim.lr_scheduler.LambdaLR``."""
        floor = self.min_lr / lr if lr > 0 else 0.0
        warmup, kind = self.warmup_steps, self.lr_schedule

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if kind == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
            falling = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
            return floor + (1.0 - floor) * falling

        return factor

    def scheduler(self, optimizer: torch.optim.Optimizer, lr: float, steps: int, *, done: int = 0):
        """The LambdaLR of this schedule over ``steps``, advanced past the ``done`` steps of a resumed run."""
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor(lr, steps))
        with warnings.catch_warnings():  # replaying the steps done, not skipping an optimizer step
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for _ in range(done):
                scheduler.step()
        return scheduler


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a `Recipe`, shared by train.py and ``autopart verify``."""
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                        help="after warmup, keep --lr or decay it to --min-lr by the last step (default constant)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warmup to --lr (default 0)")
    parser.add_argument("--min-lr", type=float, default=0.0, help="the rate cosine and linear reach (default 0)")
    parser.add_argument("--clip-grad-norm", type=float, help="clip the whole model's gradient norm to X")
    parser.add_argument("--weight-decay", type=float,
                        help="decay of the weights of 2+ dims that are no embedding (default: the optimizer's)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD's momentum, as torch.optim.SGD's (default 0)")
    parser.add_argument("--nesterov", action="store_true", help="SGD's Nesterov momentum (with --momentum)")
    parser.add_argument("--betas", metavar="B1,B2", type=betas_flag,
                        help="AdamW's moment decay rates, as torch.optim.AdamW's betas (default 0.9,0.999)")


def betas_flag(text: str) -> tuple[float, float]:
    """``--betas B1,B2`` as the two numbers it gives (argparse's type), so that flags given as
    ``0.9,0.95`` and ``0.90,0.950`` are the same value wherever they are compared."""
    try:
        first, second = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes two rates with a comma between them (0.9,0.95), got {text!r}") from None
    return first, second


def embedding_parameters(model: torch.nn.Module) -> tuple[str, ...]:
    """Every name (tied aliases included) of the weights of the model's embedding modules; works on
    the meta device."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}
    return tuple(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in tables)


def parameter_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], *, weight_decay: float | None, embeddings: Iterable[str]
) -> list[dict]:
    """The optimizer's parameter groups: decayed parameters, then the others at decay 0 (module
    docstring). No parameter at all (a rank whose stages are the loss alone) gives one empty group,
    whose steps do nothing: torch's optimizers refuse no group ("empty parameter list")."""
    tables = set(embeddings)
    decayed, kept = [], []
    for name, parameter in named:
        (decayed if _is_decayed(name, parameter.ndim, tables) else kept).append(parameter)
    first = {"params": decayed} if weight_decay is None else {"params": decayed, "weight_decay": weight_decay}
    return [group for group in (first, {"params": kept, "weight_decay": 0.0}) if group["params"]] or [{"params": []}]


def _is_decayed(name: str, ndim: int, embeddings: Iterable[str]) -> bool:
    """The rule of the module docstring, of a parameter's name and number of dimensions."""
    return ndim >= 2 and name not in embeddings


def decayed_parameters(model: torch.nn.Module | None) -> frozenset[str]:
    """The names (every alias) of the model's decayed parameters; works on the meta device. None
    (a model file loaded for its data functions only): none."""
    if model is None:
        return frozenset()
    tables = set(embedding_parameters(model))
    return frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if _is_decayed(n, p.ndim, tables))
