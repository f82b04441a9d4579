"""Hugging Face ``diffusers`` on the "tpu" device, against the same code on CPU eager.

A tiny latent-diffusion setup built from configs (no download): an ``AutoencoderKL`` (group norms, a
mid-block attention) encodes images to latents, a ``UNet2DConditionModel`` (cross-attention to text states,
timestep embeddings, down/up blocks with skip connections) learns to predict the noise ``DDPMScheduler``
added, for ``STEPS`` SGD steps; then a short DDPM sampling loop whose per-step noise comes from a CPU
``torch.Generator`` (what diffusers' ``randn_tensor`` does for a generator on another device), and the VAE
decodes. Measured on 2026-12-03 (strict and fused): losses within 2.4e-7, UNet parameters within 1.2e-7,
decoded images within 3e-6. Only fused runs here (about two minutes a mode on a loaded machine).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None,
                                reason="diffusers is not installed (pip install -e '.[test]' brings it)")

STEPS = 2

DEV_TIMEOUT = 900  # seconds a call in the worker may take (the ``dev`` fixture in conftest.py)


def latent_diffusion(mode: str) -> dict:
    """CPU and device losses, UNet parameters after training, sampled latents and decoded images."""
    import copy

    import torch
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    import tpudist.device  # noqa: F401

    torch.tpu.set_eager_mode(mode)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=8, norm_num_groups=8)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                        norm_num_groups=8, sample_size=16)
    g = torch.Generator().manual_seed(1)
    images, text = torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    noise, timesteps = torch.randn(2, 4, 8, 8, generator=g), torch.randint(0, 100, (2,), generator=g)

    def run(device):
        u, v = copy.deepcopy(unet).to(device), copy.deepcopy(vae).to(device)
        scheduler = DDPMScheduler(num_train_timesteps=100)
        opt = torch.optim.SGD(u.parameters(), lr=0.05)
        losses = []
        for _ in range(STEPS):
            with torch.no_grad():
                latents = v.encode(images.to(device)).latent_dist.mean * 0.18
            noisy = scheduler.add_noise(latents, noise.to(device), timesteps.to(device))
            loss = F.mse_loss(u(noisy, timesteps.to(device), encoder_hidden_states=text.to(device)).sample,
                              noise.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        scheduler.set_timesteps(3)
        sample_noise = torch.Generator().manual_seed(2)
        x = torch.randn(1, 4, 8, 8, generator=sample_noise).to(device)
        with torch.no_grad():
            for t in scheduler.timesteps:
                eps = u(x, t, encoder_hidden_states=text[:1].to(device)).sample
                x = scheduler.step(eps, t, x, generator=sample_noise).prev_sample
            decoded = v.decode(x / 0.18).sample
        return losses, {n: p.detach().cpu() for n, p in u.named_parameters()}, x.cpu(), decoded.cpu()

    return {"cpu": run("cpu"), "tpu": run("tpu")}


def test_latent_diffusion_trains_and_samples_like_cpu(dev):
    import torch

    r = dev(latent_diffusion, "fused")
    (cpu_losses, cpu_params, cpu_x, cpu_img), (dev_losses, dev_params, dev_x, dev_img) = r["cpu"], r["tpu"]
    torch.testing.assert_close(torch.tensor(dev_losses), torch.tensor(cpu_losses), rtol=1e-5, atol=0)
    assert sorted(dev_params) == sorted(cpu_params)
    for name, want in cpu_params.items():
        torch.testing.assert_close(dev_params[name], want, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(dev_x, cpu_x, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dev_img, cpu_img, rtol=1e-4, atol=1e-5)
