"""vLLM's `--speculative-config` and SGLang's `--speculative-*` names on `dspark serve` and in its YAML."""

from __future__ import annotations

import json

import pytest

from cli.main import build_parser
from cli.serve import serve_settings
from services.errors import InvalidRequestError

DSPARK, MTP, EAGLE3 = "dspark-target-dspark", "dspark-target-mtp", "dspark-target-eagle3"


def serve(*flags: str, config=None):
    argv = ["serve", *flags] + (["--config", str(config)] if config else [])
    return serve_settings(build_parser().parse_args(argv))


def vllm(config: dict):
    return serve("--speculative-config", json.dumps(config))


def test_vllm_speculative_config_picks_drafter_method_and_gamma():
    s = vllm({"method": "dspark", "model": DSPARK, "num_speculative_tokens": 5})
    assert (s.router.method, s.router.methods, s.router.gamma) == ("dspark", ["dspark"], 5)
    assert s.drafter.drafters == [DSPARK] and s.router.policy == "dspark"  # confidence-scheduled by default
    fixed = vllm({"method": "dspark", "model": DSPARK, "enable_adaptive_verification": False, "enforce_eager": False})
    assert fixed.router.policy == "fixed" and fixed.drafter.compile is True


def test_vllm_method_comes_from_the_checkpoint_and_mtp_aliases_are_mtp():
    assert vllm({"model": EAGLE3, "num_speculative_tokens": 4}).router.method == "eagle3"
    s = vllm({"method": "deepseek_mtp", "model": MTP, "num_speculative_tokens": 1})
    assert (s.router.method, s.router.policy, s.drafter.drafters) == ("mtp", "mtp1", [MTP])


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "dspark", "model": DSPARK, "tensor_parallel_size": 2}, "please pass draft_tensor_parallel_size"),
    ({"method": "dspark", "model": DSPARK, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
    ({"method": "dspark", "model": DSPARK, "quantization": "fp8"}, "not supported here: quantization"),
    ({"method": "dflash", "model": DSPARK}, "is a dspark drafter, not dflash"),
    ({"method": "ngram", "prompt_lookup_max": 4}, "not supported here: prompt_lookup_max"),
    ({"method": "ngram"}, "dspark generate --method ngram"),
    ({"method": "medusa", "model": DSPARK}, "Medusa heads are not served"),
    ({"method": "dspark", "model": DSPARK, "num_speculative_tokens": 17}, "1 to 16"),
    ({"method": "mtp", "model": MTP, "num_speculative_tokens": 3}, "one token per cycle"),
    ({"method": "dspark", "model": DSPARK, "rejection_sample_method": "synthetic"}, "only 'standard'"),
    ({"method": "eagle3", "model": EAGLE3, "parallel_drafting": True}, "chain drafter"),
    ({"model": "/nonexistent/drafter"}, "neither a model directory, a .gguf file nor a shipped model"),
])
def test_vllm_fields_not_honoured_are_refused_by_name(config, message):
    with pytest.raises(InvalidRequestError, match=message):
        vllm(config)


def test_sglang_flags_give_the_same_gamma_by_each_count():
    by_block = serve("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", DSPARK,
                     "--speculative-dspark-block-size", "7")
    by_width = serve("--speculative-algorithm", "dspark", "--speculative-draft-model", DSPARK,
                     "--speculative-num-draft-tokens", "8", "--speculative-eagle-topk", "1")
    assert by_block.router.gamma == by_width.router.gamma == 7 and by_block.drafter.drafters == [DSPARK]
    chain = serve("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3,
                  "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4")
    assert (chain.router.method, chain.router.gamma) == ("eagle3", 3)
    nextn = serve("--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", MTP)
    assert (nextn.router.method, nextn.router.policy) == ("mtp", "mtp1")


@pytest.mark.parametrize(("flags", "message"), [
    (["--speculative-draft-model-path", DSPARK], "--speculative-algorithm is required"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", EAGLE3], "EAGLE-1/2 heads"),
    (["--speculative-algorithm", "DSPARK", "--speculative-eagle-topk", "4"], "tree drafting"),
    (["--speculative-algorithm", "DSPARK", "--speculative-accept-threshold-single", "0.5"], "not lossless"),
    (["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "7",
      "--speculative-num-draft-tokens", "6"], "the draft counts disagree"),
    (["--speculative-algorithm", "DFLASH", "--speculative-num-steps", "4"], "one parallel step"),
    (["--speculative-algorithm", "DSPARK", "--speculative-config", "{}"], "not both"),
    (["--speculative-config", "[1, 2]"], "must be a JSON object"),
])
def test_sglang_values_not_honoured_are_refused(flags, message):
    with pytest.raises(InvalidRequestError, match=message):
        serve(*flags)


def test_the_yaml_takes_the_same_names_and_flags_replace_them(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(f"speculative_config: {{method: dspark, model: {DSPARK}, num_speculative_tokens: 4}}\n"
                    "router: {port: 9001}\n")
    from_file = serve(config=path)
    assert (from_file.router.gamma, from_file.router.port, from_file.drafter.drafters) == (4, 9001, [DSPARK])
    flags = serve("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3,
                  "--speculative-num-steps", "2", config=path)
    assert (flags.router.method, flags.router.gamma) == ("eagle3", 2)
    path.write_text("speculative_algorithm: DSPARK\nspeculative_colour: blue\n")
    with pytest.raises(InvalidRequestError, match="speculative_colour"):
        serve(config=path)


def test_a_released_checkpoint_declares_its_method_by_format(tmp_path):
    """vLLM's #49614 trap: DeepSpec's DFlash is a Qwen3DSparkModel with markov_rank 0; it is a dflash drafter."""
    for name, raw, method in (("ds", {"architectures": ["Qwen3DSparkModel"], "markov_rank": 0}, "dflash"),
                              ("dsm", {"architectures": ["Qwen3DSparkModel"], "markov_rank": 256}, "dspark"),
                              ("e3", {"architectures": ["LlamaForCausalLMEagle3"]}, "eagle3"),
                              ("zl", {"architectures": ["DFlashDraftModel"]}, "dflash")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        assert vllm({"model": str(tmp_path / name)}).router.method == method
    with pytest.raises(InvalidRequestError, match="is a dflash drafter, not dspark"):
        vllm({"method": "dspark", "model": str(tmp_path / "ds")})
