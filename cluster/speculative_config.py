"""The speculative-decoding options users already type: vLLM's `--speculative-config '<json>'` and SGLang's
`--speculative-*` flags, in `dspark serve`'s flags and its YAML (same names, snake_case), translated into
the deployment's own settings (which drafter the drafter pool hosts, the router's method, γ and policy).

Counts, as the engines define them: dspark's γ (drafts per cycle) = vLLM `num_speculative_tokens` = SGLang
`--speculative-dspark-block-size` = SGLang `--speculative-num-draft-tokens` − 1 (that counts the bonus
token too) = SGLang `--speculative-dflash-block-size` − 1 = SGLang `--speculative-num-steps` for a chain
drafter (EAGLE-3: one step per draft). Every field is either honoured or refused by name, with why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from drafter_worker.formats import declared_method, read_config, reader
from services.errors import ModelLoadError
from services.registry import resolve_model
from services.settings import Settings

SERVED = ("dspark", "dflash", "eagle3", "mtp")
_VLLM_METHODS = {m: m for m in SERVED} | {  # vLLM rewrites its per-model MTP names to "mtp"
    name: "mtp" for name in ("deepseek_mtp", "qwen3_next_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp",
                             "longcat_flash_mtp", "qwen3_5_mtp", "pangu_ultra_moe_mtp")}
_NOT_SERVED = {
    "ngram": "n-gram drafting is served by `dspark generate --method ngram`, not by the drafter tier",
    "ngram_gpu": "n-gram drafting is served by `dspark generate --method ngram`, not by the drafter tier",
    "suffix": "suffix decoding is not implemented",
    "eagle": "EAGLE-1/2 heads are not served (EAGLE-3 is: method eagle3)",
    "medusa": "Medusa heads are not served", "mlp_speculator": "MLP speculators are not served",
    "draft_model": "a separate small LM as drafter is not served (feature-conditioned drafters are)",
    "custom_class": "custom proposer classes are not served", "extract_hidden_states": "not a drafting method",
}
_SGLANG_ALGORITHMS = {"DSPARK": "dspark", "DFLASH": "dflash", "EAGLE3": "eagle3", "NEXTN": "mtp"}
_SGLANG_NOT_SERVED = {"EAGLE": _NOT_SERVED["eagle"], "NGRAM": _NOT_SERVED["ngram"],
                      "STANDALONE": _NOT_SERVED["draft_model"]}


@dataclass(frozen=True, slots=True)
class Speculative:
    """What the options ask of the deployment; None leaves the deployment's own setting."""

    method: str
    drafter: str | None = None  # checkpoint name or directory the drafter pool hosts
    gamma: int | None = None
    policy: str | None = None  # router policy: dspark (confidence-scheduled) or fixed
    compile: bool | None = None


class SpeculativeFlags(Settings):
    """vLLM's and SGLang's names, as `dspark serve` flags and top-level YAML keys."""

    speculative_config: dict[str, Any] | None = Field(
        None, description="vLLM SpeculativeConfig as JSON: method, model, num_speculative_tokens, ...")
    speculative_algorithm: str | None = Field(None, description="SGLang: DSPARK, DFLASH, EAGLE3 or NEXTN")
    speculative_draft_model_path: str | None = Field(None, description="SGLang: the drafter checkpoint")
    speculative_draft_model: str | None = Field(None, description="SGLang alias of --speculative-draft-model-path")
    speculative_num_steps: int | None = Field(None, ge=1, description="SGLang: draft steps (EAGLE-3: γ)")
    speculative_num_draft_tokens: int | None = Field(None, ge=2, description="SGLang: verify width, γ + 1")
    speculative_eagle_topk: int | None = Field(None, ge=1, description="SGLang: tokens per step; only 1 (no trees)")
    speculative_dspark_block_size: int | None = Field(None, ge=1, description="SGLang: γ of DSpark")
    speculative_dflash_block_size: int | None = Field(None, ge=2, description="SGLang: DFlash block, γ + 1")
    speculative_accept_threshold_single: float | None = Field(None, description="SGLang: only 1.0 is lossless")
    speculative_accept_threshold_acc: float | None = Field(None, description="SGLang: only 1.0 is lossless")
    speculative_use_rejection_sampling: bool | None = Field(None, description="SGLang: always on here")

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json(cls, v):
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as error:
                raise ValueError(f"--speculative-config is not JSON: {error}") from None
            if not isinstance(v, dict):
                raise ValueError("--speculative-config must be a JSON object")
        return v

    def speculative(self) -> Speculative | None:
        """The request of whichever names were given (not both families), or None."""
        sglang = {k.removeprefix("speculative_"): v for k, v in self.model_dump().items()
                  if k != "speculative_config" and v is not None}
        if self.speculative_config is not None and sglang:
            raise ValueError(f"give --speculative-config or the SGLang flags, not both (got {sorted(sglang)})")
        if self.speculative_config is not None:
            return from_vllm(self.speculative_config)
        return from_sglang(sglang) if sglang else None


def from_vllm(config: dict[str, Any]) -> Speculative:
    """vLLM's SpeculativeConfig fields → the request; any field not honoured here is refused by name."""
    c = dict(config)
    refuse_unknown(c, {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
                       "enforce_eager", "rejection_sample_method", "draft_sample_method", "parallel_drafting",
                       "enable_adaptive_verification", "tensor_parallel_size"}, "--speculative-config")
    if "tensor_parallel_size" in c:  # vLLM's own wording: the draft's TP has its own name
        raise ValueError("tensor_parallel_size is not a speculative_config field; please pass "
                         "draft_tensor_parallel_size")
    model = c.get("model")
    method = c.get("method") or checkpoint_method(model)
    if method in _NOT_SERVED:
        raise ValueError(f"speculative method {method!r}: {_NOT_SERVED[method]}")
    if method not in _VLLM_METHODS:
        raise ValueError(f"unknown speculative method {method!r} (served: {', '.join(SERVED)})")
    method = _VLLM_METHODS[method]
    if c.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("draft_tensor_parallel_size must be 1: a drafter replica is one process (scale the "
                         "drafter pool instead: --drafter-replicas)")
    if c.get("rejection_sample_method", "standard") != "standard":
        raise ValueError("rejection_sample_method: only 'standard' (the others are not lossless)")
    if c.get("draft_sample_method", "probabilistic") != "probabilistic":
        raise ValueError("draft_sample_method: only 'probabilistic': drafts are tested against the drafter's own "
                         "distribution q (greedy one-hot q is not implemented)")
    block = method in ("dspark", "dflash")
    if "parallel_drafting" in c and bool(c["parallel_drafting"]) != block:
        raise ValueError(f"parallel_drafting={c['parallel_drafting']} does not fit method {method} "
                         f"({'block' if block else 'chain'} drafter)")
    if "enable_adaptive_verification" in c and method != "dspark":
        raise ValueError("enable_adaptive_verification is a dspark option")
    policy = None
    if "enable_adaptive_verification" in c:
        policy = "dspark" if c["enable_adaptive_verification"] else "fixed"
    gamma = c.get("num_speculative_tokens")
    enforce_eager = c.get("enforce_eager")
    return checked(Speculative(method, model, gamma, policy, None if enforce_eager is None else not enforce_eager))


def from_sglang(options: dict[str, Any]) -> Speculative:
    """SGLang's `--speculative-*` values (keys without the prefix) → the request."""
    o = dict(options)
    algorithm = o.pop("algorithm", None)
    if algorithm is None:
        raise ValueError(f"--speculative-algorithm is required with --speculative-{sorted(o)[0].replace('_', '-')}")
    algorithm = algorithm.upper()
    if algorithm in _SGLANG_NOT_SERVED:
        raise ValueError(f"--speculative-algorithm {algorithm}: {_SGLANG_NOT_SERVED[algorithm]}")
    if algorithm not in _SGLANG_ALGORITHMS:
        raise ValueError(f"unknown --speculative-algorithm {algorithm} (served: {', '.join(_SGLANG_ALGORITHMS)})")
    method = _SGLANG_ALGORITHMS[algorithm]
    paths = {o.pop(k) for k in ("draft_model_path", "draft_model") if k in o}
    if len(paths) > 1:
        raise ValueError(f"--speculative-draft-model-path and --speculative-draft-model differ: {sorted(paths)}")
    if o.pop("eagle_topk", 1) != 1:
        raise ValueError("--speculative-eagle-topk: only 1 (tree drafting is not implemented)")
    for name in ("accept_threshold_single", "accept_threshold_acc"):
        if o.pop(name, 1.0) != 1.0:
            raise ValueError(f"--speculative-{name.replace('_', '-')}: only 1.0 (other values are not lossless)")
    if o.pop("use_rejection_sampling", True) is not True:
        raise ValueError("--speculative-use-rejection-sampling: always on here (it is what keeps sampling exact)")
    gammas = {}  # each count the options give, as γ
    if "num_draft_tokens" in o:
        gammas["--speculative-num-draft-tokens − 1"] = o.pop("num_draft_tokens") - 1
    if "dspark_block_size" in o:
        gammas["--speculative-dspark-block-size"] = o.pop("dspark_block_size")
    if "dflash_block_size" in o:
        gammas["--speculative-dflash-block-size − 1"] = o.pop("dflash_block_size") - 1
    steps = o.pop("num_steps", None)
    if steps is not None and method in ("eagle3", "mtp"):
        gammas["--speculative-num-steps"] = steps
    elif steps is not None and steps != 1:
        raise ValueError(f"--speculative-num-steps {steps}: a {method} block is one parallel step (use 1, or "
                         "--speculative-num-draft-tokens)")
    refuse_unknown(o, set(), "SGLang")
    if len(set(gammas.values())) > 1:
        raise ValueError(f"the draft counts disagree: {', '.join(f'{k} = {v}' for k, v in gammas.items())}")
    return checked(Speculative(method, paths.pop() if paths else None, next(iter(gammas.values()), None)))


def refuse_unknown(options: dict, honoured: set[str], where: str) -> None:
    unknown = sorted(set(options) - honoured)
    if unknown:
        raise ValueError(f"{where}: not supported here: {', '.join(unknown)} (supported: "
                         f"{', '.join(sorted(honoured)) or 'none beyond the ones given'})")


def checked(spec: Speculative) -> Speculative:
    if spec.gamma is not None and not 1 <= spec.gamma <= 16:
        raise ValueError(f"{spec.gamma} draft tokens per cycle; dspark serves 1 to 16")
    if spec.method == "mtp" and spec.gamma not in (None, 1):
        raise ValueError("an MTP module drafts one token per cycle here (num_speculative_tokens 1)")
    declared = checkpoint_method(spec.drafter) if spec.drafter else None
    if declared is not None and declared != spec.method:
        raise ValueError(f"{spec.drafter} is a {declared} drafter, not {spec.method}")
    return spec


def checkpoint_method(model: str | None) -> str | None:
    """The method a dspark drafter checkpoint declares (`dspark_drafter.method` of its config.json)."""
    if model is None:
        return None
    try:
        directory = Path(resolve_model(model))
        return declared_method(read_config(directory), str(directory))
    except ModelLoadError as error:  # not found, no config.json, or no format this version loads
        raise ValueError(f"speculative model {model!r}: {error}") from None


def carries_mtp(model: str | None) -> bool:
    """Whether a target checkpoint holds a released MTP module (DeepSeek-V3 / Qwen3-Next config.json)."""
    try:
        return model is not None and reader("mtp").matches(read_config(Path(resolve_model(model)))) is not None
    except ModelLoadError:  # not found or no config.json: the pool's own lookup reports it
        return False


def apply(spec: Speculative, router: dict, drafter: dict) -> None:
    """Write the request into the router's and the drafter pool's sections (in place)."""
    router["method"], router["methods"] = spec.method, [spec.method]
    if spec.gamma is not None:
        router["gamma"] = spec.gamma
    if spec.policy is not None:
        router["policy"] = spec.policy
    elif spec.method == "mtp":
        router["policy"] = "mtp1"
    if spec.drafter is not None:  # else the pool hosts the target's shipped drafters, this method among them
        drafter["drafters"] = [spec.drafter]
    elif spec.method == "mtp" and carries_mtp(drafter.get("model")):  # vLLM: no model = the target's own module
        drafter["drafters"] = [drafter["model"]]
    if spec.compile is not None:
        drafter["compile"] = spec.compile
