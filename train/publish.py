"""Publish stage: upload ONE export folder (model card included) to the Hugging Face Hub.

Only the files of that export folder are sent -- never training data, hidden states, checkpoints or
optimizer state. ``publish.dry_run=true`` lists exactly what would be sent and sends nothing. A
missing token, a missing export, a malformed repo id or a local path in the card or config.json is an
error before anything is sent. The uploaded model card is made again at publish time: it names
``publish.repo_id`` (the export's card names a placeholder when that was unset) and carries what is measured
now (a scripts/vllm_check.py run after the export included; an export that check failed is published with a
warning, its card saying so). Into an existing repo: refused when it is public and
``publish.private`` is true; weight files of an earlier upload are deleted in the same commit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train.errors import UserError
from train.export import (
    FORMATS,
    LICENSE_FILES,
    card_license,
    check_card_config,
    current_card,
    measurements,
    portable,
    vllm_failure,
    vllm_method_word,
)
from train.log import log
from train.stages import fingerprint, require, stage_dir

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# What an export folder may contain; anything else is refused rather than uploaded.
ALLOWED = {"config.json", "model.safetensors", "README.md", "generation_config.json", *LICENSE_FILES}
# Files of the repo an engine loads as weights: those an earlier upload left are deleted with the upload.
WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


class PublishError(UserError, ValueError):
    pass


def files_to_send(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    unexpected = [p.name for p in files if p.name not in ALLOWED]
    if unexpected:
        raise PublishError(f"{folder} holds files that are not part of an export: {unexpected}; refusing to upload")
    if not (folder / "model.safetensors").exists() or not (folder / "config.json").exists():
        raise PublishError(f"{folder} is not a complete export (model.safetensors and config.json are needed)")
    return files


def local_paths(folder: Path, cfg: DictConfig) -> list[str]:
    """Text files of the export that still name a directory of this machine."""
    return [name for name in ("README.md", "config.json") if (folder / name).exists()
            and portable((folder / name).read_text(), cfg) != (folder / name).read_text()]


def published_card(folder: Path, cfg: DictConfig, fmt: str, report: dict | None, check: dict | None) -> str | None:
    """The card as uploaded (None: the folder has none): made again from what is measured now (``report``,
    ``check``: :func:`measurements`), naming ``publish.repo_id`` as the draft's repo (the folder's card may name a
    placeholder, and lack a vLLM check run after the export)."""
    if not (folder / "README.md").exists():
        return None
    return current_card(OmegaConf.merge(cfg, {"publish": {"format": fmt}}), fmt, report, check)


def resolve_token(pcfg: DictConfig) -> str | None:
    from huggingface_hub import get_token

    return pcfg.token or os.environ.get("HF_TOKEN") or get_token()


def settings_problems(cfg: DictConfig) -> list[str]:
    """What the publish stage would refuse in its settings alone (repo id, format, token), one sentence each:
    ``train/run.py`` checks them before the first stage (after hours of training they would come late)."""
    pcfg, out = cfg.publish, []
    if not pcfg.repo_id or not REPO_ID.match(str(pcfg.repo_id)):
        out.append(f"publish.repo_id must look like 'user/name', got {pcfg.repo_id!r}")
    elif cfg.head.type == "medusa" and (word := vllm_method_word(pcfg.repo_id)):
        out.append(f"publish.repo_id {pcfg.repo_id!r} contains {word!r}: vLLM would load this Medusa head as another "
                   "method and fail; choose a name without it")
    fmt = pcfg.format or FORMATS[cfg.head.type][0]
    if fmt not in FORMATS[cfg.head.type]:
        out.append(f"publish.format {fmt!r} is not an export of a {cfg.head.type} head ({FORMATS[cfg.head.type]})")
    if not pcfg.dry_run and not resolve_token(pcfg):
        out.append("no Hugging Face token: set HF_TOKEN, publish.token, or run `hf auth login`")
    return out


def run(cfg: DictConfig) -> dict:
    pcfg = cfg.publish
    if found := settings_problems(cfg):
        raise PublishError("; ".join(found))
    if card_license(cfg) == "llama3.1" and not str(pcfg.repo_id).split("/")[1].lower().startswith("llama"):
        log(f"[publish] warning: the Llama 3.1 license asks that a model trained on Llama's outputs be named starting "
            f"with \"Llama\" ({pcfg.repo_id})")
    fmt = pcfg.format or FORMATS[cfg.head.type][0]
    marker = require(cfg, "export")
    made_by = [fingerprint(OmegaConf.merge(cfg, {"publish": {"repo_id": r}}), "export") for r in (pcfg.repo_id, None)]
    if marker.get("fingerprint") not in made_by:   # the card is made now: it must describe the weights sent
        raise PublishError(f"the export in {stage_dir(cfg, 'export')} was made from another head or config than this "
                           "command's (a retraining since, other overrides): export again with this command's "
                           "overrides, e.g. add stages=[export,publish] force=[export]")
    check_card_config(cfg, PublishError, published=True)
    folder = stage_dir(cfg, "export") / fmt
    if not folder.is_dir():
        raise PublishError(f"no export folder {folder}; run the export stage with this format first")
    if card_license(cfg) == "llama3.1" and not any((folder / n).exists() for n in LICENSE_FILES if n != "USE_POLICY.md"):
        # the target's files hold no LICENSE where from_pretrained filled the cache (it fetches weights and config)
        where = f" --local-dir {cfg.model.path}" if cfg.model.get("path") else ""   # (else: the Hub cache, read offline)
        where += f" --revision {cfg.model.revision}" if cfg.model.get("revision") else ""   # the snapshot it reads
        fetch = (f"`hf download {cfg.model.hub_id} LICENSE USE_POLICY.md{where}`" if cfg.model.hub_id else
                 f"copy the Llama 3.1 LICENSE and USE_POLICY.md into {cfg.model.get('path') or 'the target folder'}")
        terms = (f"{folder} holds no copy of the Llama 3.1 license, which its terms ask to ship with what is built on "
                 f"Llama's outputs: {fetch}, where the export finds them, then export again (add force=[export])")
        if not pcfg.dry_run:
            raise PublishError(terms)
        log(f"[publish] warning: {terms}")
    files = files_to_send(folder)
    leaks = local_paths(folder, cfg)
    if leaks:
        raise PublishError(f"{leaks} in {folder} name directories of this machine; rerun the export stage "
                           "(force=[export]) so that they name Hub ids only")
    report, check = measurements(cfg)
    if failure := vllm_failure(fmt, check):
        log(f"[publish] warning: scripts/vllm_check.py failed this export ({failure}); the card says so. Fix the "
            "export and rerun the check before publishing, unless you mean to publish it as it is")
    card = published_card(folder, cfg, fmt, report, check)
    listing = [{"path": str(p.relative_to(folder)), "bytes": p.stat().st_size} for p in files]
    for item in listing:
        log(f"[publish] {'would send' if pcfg.dry_run else 'sending'} {item['path']} ({item['bytes']} bytes)")
    if pcfg.dry_run:
        return {"dry_run": True, "repo_id": pcfg.repo_id, "private": pcfg.private, "files": listing, "card": card}
    token = resolve_token(pcfg)
    if pcfg.token:
        log("[publish] publish.token is kept in this run's .hydra/ files (not sent to the tracker): prefer HF_TOKEN "
            "or `hf auth login`")
    try:
        return _send(cfg, folder, files, card, token, listing, fmt)
    except hub_errors() as e:   # a token without write access, another user's namespace, no network
        reason = " ".join(str(e).split())
        raise PublishError(f"the Hugging Face Hub refused or could not be reached ({type(e).__name__}: {reason}); "
                           f"nothing was committed to {pcfg.repo_id}. Check the token's write access to it "
                           "(HF_TOKEN, `hf auth login`) and the network, then rerun stages=[publish]") from e


def hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub's HTTP layer raises: HTTP statuses (HfHubHTTPError, an OSError) and network failures
    (its HTTP client's base error class, whichever client this version uses)."""
    from huggingface_hub.errors import HfHubHTTPError

    return OSError, HfHubHTTPError, HfHubHTTPError.__mro__[1]


def _send(cfg: DictConfig, folder: Path, files: list[Path], card: str | None, token: str, listing: list[dict],
          fmt: str) -> dict:
    """One commit of ``files`` (the card as made now) to ``publish.repo_id``, stale weights deleted in it."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    pcfg = cfg.publish
    api = HfApi(token=token)
    url = api.create_repo(pcfg.repo_id, private=pcfg.private, exist_ok=True, repo_type="model")
    # create_repo leaves an existing repo's visibility as it is: a public one would take the head publicly.
    if pcfg.private and not api.repo_info(pcfg.repo_id, repo_type="model").private:
        raise PublishError(f"{pcfg.repo_id} exists and is public while publish.private=true; nothing was sent. Make "
                           "it private on the Hub (its Settings), or publish there with publish.private=false")
    sent = [str(p.relative_to(folder)) for p in files]
    stale = [f for f in api.list_repo_files(pcfg.repo_id, repo_type="model")  # at the top, where engines look
             if f not in sent and "/" not in f and f.endswith(WEIGHTS)]
    if stale:
        log(f"[publish] deleting {stale} from {pcfg.repo_id} in the same commit: weights of an earlier upload, which "
            "engines would load beside these (or instead: vLLM follows an index file)")
    operations = [CommitOperationAdd(path_in_repo=path,
                                     path_or_fileobj=card.encode() if p.name == "README.md" and card is not None else str(p))
                  for path, p in zip(sent, files, strict=True)] + [CommitOperationDelete(path_in_repo=f) for f in stale]
    api.create_commit(repo_id=pcfg.repo_id, operations=operations, repo_type="model",
                      commit_message=f"Upload {cfg.head.type} draft head ({fmt} format)")
    log(f"[publish] uploaded {len(listing)} files to {url}")
    return {"dry_run": False, "repo_id": pcfg.repo_id, "url": str(url), "files": listing, "deleted": stale}
