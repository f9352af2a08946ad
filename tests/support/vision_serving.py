"""The `cpu` profile serving the tiny vision model (issue 58), and images to send it.

The shipped `cpu` profile's target (`qwen38 tiny`'s `Qwen3_5ForCausalLM`) has no tower, so
VISION=true is refused there. `cpu-vision` is the `cpu` profile with one change of model: its
target is `qwen38 generate --size tiny-vision` (the same tiny text model as a
`Qwen3_5ForConditionalGeneration` with a generated 2-block ViT), and it serves no adapter (the
tiny adapter is bound to the text-only target). Everything else, the engine table included, is
the `cpu` profile's.
"""

from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path

from core.profiles import PROFILES_DIR
from prepare.generate import generate_model
from prepare.synthetic import TINY_VISION_PRESET

VISION_TARGET = "tiny/target-vision"


def vision_profiles(directory: Path) -> Path:
    """``directory`` with the repository's profiles plus `cpu-vision`."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in PROFILES_DIR.glob("*.toml"):
        shutil.copy(path, directory)
    text = (PROFILES_DIR / "cpu.toml").read_text()
    for old, new in (
        ('[models.target]\ndir = "tiny/target"', f'[models.target]\ndir = "{VISION_TARGET}"'),
        ('adapter = "qwen3.8-27b-mode-b"\n', ""),
        ('[models.adapter]\ndir = "tiny/adapter"\ngenerated = "tiny"\n', ""),
        ("[lora]\nmax_lora_rank = 1\nmax_loras = 1\n", ""),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (directory / "cpu-vision.toml").write_text(text)
    return directory


def vision_models(root: Path, tiny_root: Path) -> Path:
    """MODELS_DIR ``root``: the session's tiny models (linked) and the tiny vision target."""
    (root / "tiny").mkdir(parents=True, exist_ok=True)
    for part in (tiny_root / "tiny").iterdir():
        (root / "tiny" / part.name).symlink_to(part, target_is_directory=True)
    generate_model(root / VISION_TARGET, TINY_VISION_PRESET, "qwen3.8-27b-bf16")
    return root


def png(size: tuple[int, int], color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"
