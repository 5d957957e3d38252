"""The Hugging Face Hub upload of `export-hf --push-to-hub`."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError


def push_to_hub(folder: Path, repo: str, private: bool = False) -> str:
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError("--push-to-hub needs the huggingface_hub package: pip install huggingface_hub") from None
    if repo.count("/") != 1:
        raise ConfigError(f"--push-to-hub {repo!r}: give the repository as OWNER/NAME")
    api = HfApi()
    api.create_repo(repo_id=repo, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="Upload model exported by llamatron")
    return f"https://huggingface.co/{repo}"


__all__ = ["push_to_hub"]
