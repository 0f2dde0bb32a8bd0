"""--push_to_hub: the Hub is checked before training starts (network, login, repository name), and
final/ is uploaded at the end, so that no run fails on the Hub after hours of training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlm_ddp.config import RunConfig
from mlm_ddp.errors import BadInput, RunEnded


class HubUploadError(RunEnded):
    """The run finished and final/ is saved, but the upload failed (exit 1)."""


def offline() -> bool:
    """HF_HUB_OFFLINE (as huggingface_hub itself reads it): no request may leave this machine."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or bool(getattr(constants, "is_offline_mode", lambda: False)())


def check_hub(run: RunConfig, uploads: bool) -> str | None:
    """The repository --push_to_hub uploads to, after checking that it can (None: no push, or this
    process does not upload). Every rank checks that the Hub is not switched off; only the one that
    `uploads` (rank 0) asks the Hub who the token belongs to: 512 ranks asking at once would meet the
    Hub's rate limit on some of them, and those alone would stop."""
    if not run.push_to_hub:
        return None
    if offline():
        raise BadInput("--push_to_hub: the Hub is switched off here (HF_HUB_OFFLINE is set), so the upload at the "
                       "end would fail after training; unset HF_HUB_OFFLINE or drop --push_to_hub (final/ is "
                       "uploadable later with `hf upload REPO OUTPUT_DIR/final`)")
    if not uploads:
        return None
    from huggingface_hub import HfApi

    try:
        user = HfApi(token=run.hub_token).whoami()["name"]
    except Exception as err:  # noqa: BLE001 - no network, a bad or missing token: each its own type
        raise BadInput(f"--push_to_hub: the Hub cannot be reached or the token is not valid ({type(err).__name__}: "
                       f"{str(err).strip()[:200]}); log in with `hf auth login`, pass --hub_token, or drop "
                       "--push_to_hub") from err
    repo = run.hub_model_id or f"{user}/{Path(run.output_dir).resolve().name}"
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise BadInput(f"--hub_model_id {repo!r}: a Hub repository is named 'user/name'")
    return repo


def push(final: Path, repo: str, run: RunConfig, steps: int) -> Any:
    """Upload final/ to `repo` (created if it does not exist, private by the Hub's default)."""
    from huggingface_hub import HfApi

    api = HfApi(token=run.hub_token)
    try:
        api.create_repo(repo, exist_ok=True)
        return api.upload_folder(repo_id=repo, folder_path=final,
                                 commit_message=f"mlm_ddp: final model after {steps} steps")
    except Exception as err:  # noqa: BLE001 - network, permissions, quota: each its own type
        raise HubUploadError(f"the run finished and {final} is saved, but the upload to {repo} failed "
                             f"({type(err).__name__}: {str(err).strip()[:300]}); retry with "
                             f"`hf upload {repo} {final}`") from err
