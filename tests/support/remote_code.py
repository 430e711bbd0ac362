"""A checkpoint that ships its own code: the tiny LLaVA with its config class as checkpoint code
(config.json's auto_map names it, for a model type neither transformers nor vLLM knows), so that
every stage that loads it without `trust_remote_code` fails: what the setting is for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REMOTE_CONFIG = """from transformers import LlavaConfig


class IrisLlavaConfig(LlavaConfig):
    model_type = "iris_llava"
"""
CODE_FILE = "configuration_iris_llava.py"


def remote_code_llava(llava: str | Path, folder: Path) -> Path:
    """`folder`: a copy of the LLaVA checkpoint at `llava` whose config class is checkpoint code."""
    shutil.copytree(llava, folder)
    (folder / CODE_FILE).write_text(REMOTE_CONFIG)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="iris_llava", auto_map={"AutoConfig": "configuration_iris_llava.IrisLlavaConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder
