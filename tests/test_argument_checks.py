"""The argument checks that run before torch loads refuse exactly what the loaders would refuse, and word it as they
do."""

from pathlib import Path

import pytest

from vaeopt.cli.paths import check_model_exists
from vaeopt.errors import VaeoptError


@pytest.mark.parametrize("hub_id", ["Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "stabilityai/stable-diffusion-3.5-large",
                                    "Lightricks/LTX-2.0"])
def test_hub_ids_with_a_dot_are_left_to_the_loader(hub_id, tmp_path, monkeypatch):
    # a dot in the repository name reads as a suffix to Path; the loader's message says how to fetch such an id
    monkeypatch.chdir(tmp_path)
    check_model_exists(Path(hub_id))


def test_missing_checkpoint_files_are_refused_early(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("vae.safetensors", "models/vae.safetensors", "./Wan2.1", str(tmp_path / "gone" / "diffusion_vae")):
        with pytest.raises(VaeoptError, match="checkpoint not found"):
            check_model_exists(Path(name))


def test_decode_names_a_dotted_hub_id_as_one():
    from typer.testing import CliRunner

    from vaeopt.cli import app

    z = Path(__file__).parent.parent / "samples" / "tiny_kl_image_latents.pt"
    r = CliRunner().invoke(app, ["decode", str(z), "-m", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"], catch_exceptions=False)
    assert r.exit_code == 2 and "Hugging Face Hub id" in r.output
    assert "huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in r.output
