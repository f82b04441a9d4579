"""Vision, mixed-precision, Hugging Face and recurrent models nobody here wrote, trained on the "tpu"
device (Strict, some Fused and ``torch.compile(backend="tpu")``) against the same training on CPU
eager from the same initial weights.

The models are written the way their authors write them: torchvision-style ResNet basic blocks with
BatchNorm (trained, then evaluated with the running statistics), MobileNetV2 inverted residuals
(depthwise convolutions, ReLU6; also on channels_last inputs), EfficientNet MBConv blocks
(squeeze-excite, SiLU, stochastic depth at p=0), a ViT (convolutional patch embedding, class token,
position embedding), a decoder that upsamples with bilinear (both align_corners), nearest and bicubic
``F.interpolate`` plus ``pixel_shuffle``, a spatial transformer (``affine_grid`` + ``grid_sample`` in
three padding modes), the ResNet in bfloat16, Hugging Face Mistral (sliding window, eager and SDPA),
Gemma, Gemma 2 (logit soft-capping), ViT, Whisper (conv1d front end), BERT MLM and T5 (gated-GELU) from
small random configs, and the word-language-model example's RNN (2-layer bidirectional LSTM + GRU, tied
decoder) trained with truncated backpropagation through time (hidden state detached between chunks).

Found and fixed with these (each has an op-level test in tests/ops/test_ops_lowerings.py):
- the spatial transformer raised UnsupportedOp: ``grid_sampler_2d_backward`` had no lowering;
- the bf16 ResNet: batch norm's statistics were not rounded as torch's CPU kernel rounds them (outputs
  1 ulp off, saved statistics float32), and bf16 ``log_softmax`` along the last dim was 1 ulp off in a
  third of the elements, so every gradient differed from CPU's bf16.

Each case trains ``STEPS`` steps with a real optimizer (SGD with momentum; Adam/AdamW where no parameter
has a gradient of pure rounding noise, which Adam would normalise to a full step either way) and
gradient clipping. float32: losses within 1e-5 relative at every step, every gradient within 1e-4 of the
step's largest, parameters and buffers after the last step within 1e-3 of how far training moved them,
the eval-mode output after training within 1e-4. Measured: losses <= 3.5e-7, gradients <= 1.2e-5
(Whisper's decoder embedding), states <= 7e-5 of their movement.
All cases run in one worker process that installs the device (it renames PrivateUse1 for the process).
"""

from __future__ import annotations

import pytest

from tpudist.testing import RankPool

STEPS = 3


@pytest.fixture(scope="module")
def dev():
    with RankPool(1, backend=None, timeout=600, env={"TPUDIST_EAGER_MODE": "strict"}) as pool:
        yield lambda fn, *a, **k: pool.run(fn, *a, **k)[0]


# -- models (in the worker) -----------------------------------------------------------------------------


def _vision_models():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class BasicBlock(nn.Module):
        """torchvision.models.resnet.BasicBlock."""

        expansion = 1

        def __init__(self, inplanes, planes, stride=1, downsample=None):
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = downsample

        def forward(self, x):
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            out += identity
            return self.relu(out)

    class ResNet(nn.Module):
        def __init__(self, num_classes=5):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            down = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
            self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, 2, down))
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(16, num_classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            for m in self.modules():
                if isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0.5)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.avgpool(self.layer1(x))
            return self.fc(torch.flatten(x, 1))

    class InvertedResidual(nn.Module):
        """torchvision.models.mobilenetv2.InvertedResidual."""

        def __init__(self, inp, oup, stride, expand_ratio):
            super().__init__()
            hidden = inp * expand_ratio
            self.use_res_connect = stride == 1 and inp == oup
            layers = []
            if expand_ratio != 1:
                layers += [nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
            layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                       nn.ReLU6(inplace=True), nn.Conv2d(hidden, oup, 1, bias=False), nn.BatchNorm2d(oup)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.use_res_connect else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self, num_classes=5):
            super().__init__()
            self.features = nn.Sequential(
                nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True)),
                InvertedResidual(8, 8, 1, 1), InvertedResidual(8, 12, 2, 4), InvertedResidual(12, 12, 1, 4))
            self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(12, num_classes))

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
            return self.classifier(torch.flatten(x, 1))

    def stochastic_depth(x, p, mode, training=True):
        """torchvision.ops.stochastic_depth."""
        if not training or p == 0.0:
            return x
        size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
        noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        return x * noise.div_(1 - p)

    class SqueezeExcitation(nn.Module):
        """torchvision.ops.SqueezeExcitation."""

        def __init__(self, input_channels, squeeze_channels):
            super().__init__()
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
            self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
            self.activation, self.scale_activation = nn.SiLU(), nn.Sigmoid()

        def forward(self, x):
            scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
            return scale * x

    class MBConv(nn.Module):
        """torchvision.models.efficientnet.MBConv (expand, depthwise, squeeze-excite, project)."""

        def __init__(self, cin, cout, expand, stride, sd_prob):
            super().__init__()
            hidden = cin * expand
            self.use_res_connect = stride == 1 and cin == cout
            self.block = nn.Sequential(
                nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden, eps=1e-3), nn.SiLU(inplace=True),
                nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden, eps=1e-3),
                nn.SiLU(inplace=True), SqueezeExcitation(hidden, max(1, cin // 4)),
                nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3))
            self.sd_prob = sd_prob

        def forward(self, x):
            out = self.block(x)
            if self.use_res_connect:
                out = stochastic_depth(out, self.sd_prob, "row", self.training) + x
            return out

    class EfficientNet(nn.Module):
        def __init__(self, num_classes=5):
            super().__init__()
            self.features = nn.Sequential(
                nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8, eps=1e-3), nn.SiLU()),
                MBConv(8, 8, 4, 1, 0.0), MBConv(8, 16, 4, 2, 0.0))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Sequential(nn.Dropout(p=0.0, inplace=True), nn.Linear(16, num_classes))

        def forward(self, x):
            return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

    class ViT(nn.Module):
        """torchvision.models.vision_transformer.VisionTransformer, small."""

        def __init__(self, image_size=16, patch_size=4, hidden_dim=16, num_classes=5):
            super().__init__()
            self.patch_size, self.hidden_dim = patch_size, hidden_dim
            self.conv_proj = nn.Conv2d(3, hidden_dim, patch_size, patch_size)
            seq_length = (image_size // patch_size) ** 2 + 1
            self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
            self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
            layer = nn.TransformerEncoderLayer(hidden_dim, 2, 32, dropout=0.0, activation="gelu", batch_first=True,
                                               norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)
            self.heads = nn.Linear(hidden_dim, num_classes)

        def forward(self, x):
            n = x.shape[0]
            x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
            x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1) + self.pos_embedding
            return self.heads(self.ln(self.encoder(x))[:, 0])

    class Upsampler(nn.Module):
        """A segmentation-style decoder: every interpolation mode, both align_corners, pixel_shuffle."""

        def __init__(self):
            super().__init__()
            self.enc = nn.Conv2d(3, 8, 3, 2, 1)
            self.ps = nn.Conv2d(8, 3 * 4, 3, 1, 1)
            self.mix = nn.Conv2d(8 * 4 + 3, 4, 1)

        def forward(self, x):
            h, w = x.shape[-2:]
            f = torch.tanh(self.enc(x))
            ups = [F.interpolate(f, size=(h, w), mode="bilinear", align_corners=False),
                   F.interpolate(f, size=(h, w), mode="bilinear", align_corners=True),
                   F.interpolate(f, scale_factor=2, mode="nearest"),
                   F.interpolate(f, size=(h, w), mode="bicubic", align_corners=False)]
            return self.mix(torch.cat([*ups, F.pixel_shuffle(self.ps(f), 2)], 1))

    class SpatialTransformer(nn.Module):
        """The spatial transformer network tutorial: a localization net predicts an affine grid."""

        def __init__(self, num_classes=5):
            super().__init__()
            self.localization = nn.Sequential(nn.Conv2d(3, 4, 5), nn.MaxPool2d(2), nn.ReLU(True))
            self.fc_loc = nn.Sequential(nn.Linear(4 * 6 * 6, 16), nn.ReLU(True), nn.Linear(16, 6))
            self.fc_loc[2].weight.data.normal_(std=0.01)
            self.fc_loc[2].bias.data.copy_(torch.tensor([0.9, 0.1, 0.05, -0.1, 0.8, 0.0]))
            self.head = nn.Linear(3 * 16 * 16 * 3, num_classes)

        def forward(self, x):
            theta = self.fc_loc(self.localization(x).flatten(1)).view(-1, 2, 3)
            grid = F.affine_grid(theta, list(x.size()), align_corners=False)
            grid_c = F.affine_grid(theta, list(x.size()), align_corners=True)
            outs = [F.grid_sample(x, grid, align_corners=False),
                    F.grid_sample(x, grid_c, mode="bilinear", padding_mode="border", align_corners=True),
                    F.grid_sample(x, grid * 1.2, mode="bilinear", padding_mode="reflection", align_corners=False)]
            return self.head(torch.cat(outs, 1).flatten(1))

    return dict(ResNet=ResNet, MobileNetV2=MobileNetV2, EfficientNet=EfficientNet, ViT=ViT, Upsampler=Upsampler,
                SpatialTransformer=SpatialTransformer)


def _rnn_lm():
    from torch import nn

    class RNNLM(nn.Module):
        """The word_language_model example's RNNModel, bidirectional and stacked, tied decoder."""

        def __init__(self, ntoken=40, ninp=16, nhid=8):
            super().__init__()
            self.encoder = nn.Embedding(ntoken, ninp)
            self.lstm = nn.LSTM(ninp, nhid, num_layers=2, dropout=0.0, batch_first=False, bidirectional=True)
            self.gru = nn.GRU(2 * nhid, ninp // 2, num_layers=2, bidirectional=True)
            self.decoder = nn.Linear(ninp, ntoken)
            self.decoder.weight = self.encoder.weight
            self.ntoken = ntoken

        def forward(self, x, hidden):
            (h, c), hg = hidden
            out, (h, c) = self.lstm(self.encoder(x), (h, c))
            out, hg = self.gru(out, hg)
            return self.decoder(out).view(-1, self.ntoken), ((h, c), hg)

        def init_hidden(self, bsz, device):
            import torch

            z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
            return (z(4, bsz, 8), z(4, bsz, 8)), z(4, bsz, 8)

    return RNNLM()


def _hf(name):
    import transformers as T

    common = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if name == "hf_mistral":
        return T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=4, attn_implementation="eager"))
    if name == "hf_mistral_sdpa":
        return T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=4, attn_implementation="sdpa"))
    if name == "hf_gemma":
        return T.GemmaForCausalLM(T.GemmaConfig(**common, head_dim=8))
    if name == "hf_gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
                                                  final_logit_softcapping=30.0, attn_implementation="eager"))
    if name == "hf_vit":
        return T.ViTForImageClassification(T.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if name == "hf_whisper":
        return T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=48, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
            max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, suppress_tokens=None,
            begin_suppress_tokens=None))
    if name == "hf_bert_mlm":
        return T.BertForMaskedLM(T.BertConfig(
            vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if name == "hf_t5":
        return T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=48, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            feed_forward_proj="gated-gelu"))
    raise KeyError(name)


VISION = ("ResNet", "MobileNetV2", "EfficientNet", "ViT", "Upsampler", "SpatialTransformer")
HF = ("hf_mistral", "hf_mistral_sdpa", "hf_gemma", "hf_gemma2", "hf_vit", "hf_whisper", "hf_bert_mlm", "hf_t5")


def _case(name: str):
    """(build, batches, loss_fn(model, batch, device), make_optimizer, eval_batch or None)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    base = name.removesuffix("_channels_last").removesuffix("_bf16")
    if base in VISION:
        cls = _vision_models()[base]
        size = 16
        images = [(torch.randn(4, 3, size, size, generator=g) * 1.5 + 0.5, torch.randint(0, 5, (4,), generator=g))
                  for _ in range(STEPS + 1)]
        if name.endswith("_channels_last"):
            images = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in images]
        if base == "Upsampler":
            images = [(x, torch.randn(4, 4, size, size, generator=g)) for x, _ in images]

            def loss_fn(model, batch, device):
                x, y = batch
                return F.mse_loss(model(x.to(device)), y.to(device))
        else:
            def loss_fn(model, batch, device):
                x, y = batch
                return F.cross_entropy(model(x.to(device)), y.to(device))
        # Adam normalises each step: an attention key bias (gradient 0 up to rounding) would step either way
        opt = adam if base == "Upsampler" else sgd
        build = cls
        if name.endswith("_bf16"):
            build = lambda: cls().to(torch.bfloat16)  # noqa: E731
            images = [(x.bfloat16(), y) for x, y in images]
        return build, images[:STEPS], loss_fn, opt, images[STEPS]
    if name == "rnn_tbptt":
        data = torch.randint(0, 40, (4 * STEPS + 1, 3), generator=g)  # (time, batch): bptt chunks of 4
        chunks = [(data[i:i + 4], data[i + 1:i + 5]) for i in range(0, 4 * STEPS, 4)]
        return _rnn_lm, chunks, None, lambda ps: torch.optim.SGD(ps, lr=0.5), None
    if name in HF:
        tokens = lambda *s: torch.randint(3, 48, s, generator=g)  # noqa: E731
        if name == "hf_vit":
            batches = [dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g),
                            labels=torch.randint(0, 5, (2,), generator=g)) for _ in range(STEPS)]
        elif name == "hf_whisper":
            batches = [dict(input_features=torch.randn(2, 8, 32, generator=g), labels=tokens(2, 6))
                       for _ in range(STEPS)]
        elif name == "hf_bert_mlm":
            batches = []
            for _ in range(STEPS):
                ids, mask = tokens(2, 10), torch.ones(2, 10, dtype=torch.long)
                mask[1, 7:] = 0
                labels = torch.where(torch.rand(2, 10, generator=g) < 0.3, ids, torch.full_like(ids, -100))
                labels[0, 0] = ids[0, 0]
                batches.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
        elif name == "hf_t5":
            batches = []
            for _ in range(STEPS):
                mask = torch.ones(2, 10, dtype=torch.long)
                mask[1, 6:] = 0
                batches.append(dict(input_ids=tokens(2, 10), attention_mask=mask, labels=tokens(2, 5)))
        else:
            batches = [dict(input_ids=tokens(2, 10), labels=tokens(2, 10)) for _ in range(STEPS)]

        def loss_fn(model, batch, device):
            return model(**{k: v.to(device) for k, v in batch.items()}).loss
        # SGD where attention has a key bias (HF ViT, BERT): Adam would step its rounding-noise gradient
        opt = sgd if name in ("hf_vit", "hf_bert_mlm") else (lambda ps: torch.optim.AdamW(ps, lr=3e-3))
        return (lambda: _hf(name)), batches, loss_fn, opt, None
    raise KeyError(name)


def _train(name, device, compiled=False):
    """Per-step losses and gradients, the state after the last step, and the eval-mode output."""
    import torch

    build, batches, loss_fn, make_opt, eval_batch = _case(name)
    torch.manual_seed(0)
    model = build().to(device)
    model.train()
    opt = make_opt(list(model.parameters()))
    losses, grads = [], []
    if name == "rnn_tbptt":
        import torch.nn.functional as F

        hidden = model.init_hidden(3, device)

        def loss_fn(model, batch, device):
            nonlocal hidden
            hidden = torch.utils._pytree.tree_map(lambda t: t.detach(), hidden)  # truncated BPTT
            x, y = batch
            out, hidden = model(x.to(device), hidden)
            return F.cross_entropy(out, y.to(device).reshape(-1))
    step = torch.compile(loss_fn, backend="tpu") if compiled else loss_fn
    for batch in batches:
        loss = step(model, batch, device)
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad.detach().cpu().float().clone()  # a copy: clipping scales CPU grads in place
                      for k, p in model.named_parameters() if p.grad is not None})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().cpu() for k, v in (*model.named_parameters(), *model.named_buffers())}
    out = None
    if eval_batch is not None:
        model.eval()
        with torch.no_grad():
            out = model(eval_batch[0].to(device)).cpu().float()
    return losses, grads, state, out


def run_case(name: str, way: str) -> dict:
    """Errors of the run in ``way`` (strict, fused, compile) against CPU eager, or the error text."""
    import torch

    import tpudist.device  # noqa: F401

    torch._dynamo.reset()
    build = _case(name)[0]
    torch.manual_seed(0)
    first = build()
    initial = {k: v.detach().clone() for k, v in (*first.named_parameters(), *first.named_buffers())}
    want_losses, want_grads, want_state, want_out = _train(name, "cpu")
    fallbacks_before = dict(torch.tpu.cache_stats()["cpu_fallback_ops"])
    try:
        with torch.tpu.eager_mode("fused" if way == "fused" else "strict"):
            losses, grads, state, out = _train(name, "tpu", compiled=way == "compile")
    except Exception as e:  # noqa: BLE001 - reported by name to the test process
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    fallbacks = {k: v - fallbacks_before.get(k, 0) for k, v in torch.tpu.cache_stats()["cpu_fallback_ops"].items()
                 if v != fallbacks_before.get(k, 0)}
    loss_err = max(abs(a - b) / abs(a) for a, b in zip(want_losses, losses))
    grad_err, worst_grad = 0.0, None
    for want, got in zip(want_grads, grads):
        scale = max(t.abs().max().item() for t in want.values())
        if set(want) != set(got):
            return {"error": f"gradients of {sorted(set(want) ^ set(got))} on one side only"}
        for k in want:
            e = (want[k] - got[k]).abs().max().item() / scale
            if not e <= grad_err:
                grad_err, worst_grad = e, k
    state_err, worst_state = 0.0, None
    for k, want in want_state.items():
        got = state[k]
        if got.dtype != want.dtype or got.shape != want.shape:
            return {"error": f"{k}: {got.dtype} {tuple(got.shape)}, cpu {want.dtype} {tuple(want.shape)}"}
        if not want.is_floating_point():
            e = 0.0 if torch.equal(got, want) else float("inf")
        else:
            moved = (want.float() - initial[k].float()).norm().item()
            e = (got.float() - want.float()).norm().item() / (moved + 1e-3)
        if not e <= state_err:
            state_err, worst_state = e, k
    out_err = 0.0 if want_out is None else ((out - want_out).abs().max() / want_out.abs().max()).item()
    inexact = sorted(k for k in want_grads[0] if not torch.equal(want_grads[0][k], grads[0][k]))
    dtype = next(first.parameters()).dtype  # the gradients come back as float32 copies
    ulps = {k: _ulps(want_grads[0][k].to(dtype), grads[0][k].to(dtype)) for k in inexact} if dtype.itemsize == 2 else {}
    return {"loss": loss_err, "grad": grad_err, "worst_grad": worst_grad, "state": state_err, "inexact": inexact,
            "ulps": ulps,
            "worst_state": worst_state, "eval": out_err, "fallbacks": fallbacks, "losses": losses}


# -- tests --------------------------------------------------------------------------------------------
# A subset keeps the file fast. Probed by hand with run_case (2026-12-03), all within FP32: every vision
# model, the channels_last ResNet/MobileNetV2 and rnn_tbptt in strict and fused; ResNet, ViT, Upsampler,
# SpatialTransformer and rnn_tbptt compiled; every HF case in strict. HF cases in fused mode and
# compiled are not probed.

FP32 = dict(loss=1e-5, grad=1e-4, state=1e-3, eval=1e-4)


def _ulps(want, got) -> tuple[float, int]:
    """(the fraction of elements that differ, the most units in the last place one differs by) of two
    16-bit float tensors (their bit patterns as integers: adjacent values of one sign differ by one)."""
    import torch

    distance = (want.view(torch.int16).int() - got.view(torch.int16).int()).abs()
    return (want != got).float().mean().item(), int(distance.max().item())


def _check(out, tol):
    assert "error" not in out, out
    assert not out["fallbacks"], out
    for key, limit in tol.items():
        assert out[key] <= limit, (key, out)  # NaN fails too


@pytest.mark.parametrize("name", [*VISION, "MobileNetV2_channels_last", "rnn_tbptt"])
def test_models_train_like_cpu_strict(dev, name):
    _check(dev(run_case, name, "strict"), FP32)


@pytest.mark.parametrize("name", ["MobileNetV2", "SpatialTransformer"])
def test_models_train_like_cpu_fused(dev, name):
    _check(dev(run_case, name, "fused"), FP32)


@pytest.mark.parametrize("name", ["SpatialTransformer", "rnn_tbptt"])  # the zoo compiles a BatchNorm ResNet
def test_compiled_models_train_like_cpu(dev, name):
    _check(dev(run_case, name, "compile"), FP32)


def test_bf16_resnet_trains_like_cpu_bf16(dev):
    """model.to(torch.bfloat16): the forward and the step-1 gradients equal CPU's bf16 for every parameter
    past the stem, bit for bit on most CPUs (they failed before the batch norm and log_softmax fixes: every
    gradient differed). On a CPU with native bf16 dot products (AVX512-BF16: oneDNN's bf16 convolution
    backward), a few elements of a conv weight's gradient past the stem are 1 ulp off (0.17% of
    layer1.0.conv1.weight's, measured on an AMD EPYC). The stem's gradients differ more: the CPU's
    max_pool2d backward adds overlapping windows into bf16 one by one, the device in float32. Those ulps
    then move the gradient-clipping coefficient, so later steps are compared at bf16 tolerances. The
    reported bf16 loss may be 1 ulp off: the CPU's nll_loss sums the batch in bf16 (a cascade of bf16
    partial sums), the device in float32; its gradient does not depend on that sum."""
    out = dev(run_case, "ResNet_bf16", "strict")
    _check(out, dict(loss=2e-2, grad=5e-2, eval=5e-2))
    past_stem = {k: out["ulps"][k] for k in out["inexact"] if k not in {"conv1.weight", "bn1.weight", "bn1.bias"}}
    assert all(ulp <= 1 and fraction <= 0.01 for fraction, ulp in past_stem.values()), (past_stem, out)


def run_activation_backwards(mode: str) -> dict:
    """bf16 silu/mish gradients (and their double backward) on the device against CPU: elements that differ."""
    import torch
    import torch.nn.functional as F

    import tpudist.device  # noqa: F401

    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(4000, generator=g) * 2).bfloat16(), (torch.randn(4000, generator=g) * 1e-3).bfloat16()
    out = {}
    with torch.tpu.eager_mode(mode):
        for name, fn in (("silu", F.silu), ("mish", F.mish)):
            got = []
            for device in ("cpu", "tpu"):
                xx = x.to(device).detach().clone().requires_grad_()
                grad, = torch.autograd.grad(fn(xx), xx, dy.to(device), create_graph=True)
                grad2, = torch.autograd.grad(grad.float().sum(), xx)
                got.append((grad.detach().cpu(), grad2.cpu()))
            out[name] = ((got[0][0] != got[1][0]).sum().item(), (got[0][1] != got[1][1]).sum().item())
    return out


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_bf16_silu_and_mish_gradients_are_bit_equal_to_cpu(dev, mode):
    """silu_backward and mish_backward have a CPU kernel and a CompositeImplicitAutograd one; the device
    skipped registering its kernel for them, so on tpu tensors they decomposed into bf16 tensor ops,
    each rounded: 40-51% of bf16 silu gradients 1 ulp off (found in bf16 Mistral/Gemma: every gradient
    below the first MLP differed). Double backward still works (their autograd kernel is VariableType's);
    in Fused mode its chain of bf16 ops is one XLA program, which may skip rounding between them (XLA's
    allow_excess_precision): 10-20% of its elements 1 ulp off, so only Strict compares it bit for bit."""
    out = dev(run_activation_backwards, mode)
    assert [v[0] for v in out.values()] == [0, 0], out
    if mode == "strict":
        assert out == {"silu": (0, 0), "mish": (0, 0)}, out


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("name,mode", [("hf_mistral", "strict"), ("hf_gemma2", "strict"), ("hf_whisper", "strict"),
                                       ("hf_vit", "strict"), ("hf_mistral_sdpa", "fused")])
def test_hf_models_train_like_cpu(dev, name, mode):
    _check(dev(run_case, name, mode), FP32)
