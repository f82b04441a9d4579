"""Small real architectures for the model zoo (``test_model_zoo.py``): built from configs, no weights downloaded.

Each builder returns ``(model, batches, loss_fn)`` on the CPU, seeded, with every dropout at zero so
that a run on the device can be compared step by step with CPU eager. ``loss_fn(model, batch)`` returns
the scalar loss the step minimises. The Hugging Face families need ``transformers`` (an optional extra):
``HF_FAMILIES`` lists them so the test can skip them with a reason when it is absent.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, BATCH, STEPS = 64, 12, 2, 4


def _tokens(seed: int, shape=(BATCH, SEQ)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _padding_mask(seed: int) -> torch.Tensor:
    """Right padding of different lengths per row: exercises masked attention."""
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = SEQ
    return (torch.arange(SEQ)[None, :] < lengths[:, None]).long()


# -- Hugging Face transformers families --------------------------------------------------------------


def _hf_loss(model, batch):
    return model(**batch).loss


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    batches = [dict(input_ids=_tokens(s), labels=_tokens(s)) for s in range(STEPS)]
    return model, batches, _hf_loss


def hf_gpt2():
    """Decoder with tied embedding / LM head, learned positions, Conv1D projections."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    batches = [dict(input_ids=_tokens(s), labels=_tokens(s)) for s in range(STEPS)]
    return model, batches, _hf_loss


def hf_bert():
    """Encoder MLM with tied weights and a key-padding attention mask."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(cfg)
    batches = []
    for s in range(STEPS):
        mask = _padding_mask(100 + s)
        labels = torch.where(mask.bool(), _tokens(200 + s), torch.full_like(mask, -100))
        batches.append(dict(input_ids=_tokens(s), attention_mask=mask, labels=labels))
    return model, batches, _hf_loss


def hf_t5():
    """Encoder-decoder with relative position buckets and tied embeddings."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg)
    batches = [dict(input_ids=_tokens(s), attention_mask=_padding_mask(100 + s), labels=_tokens(300 + s, (BATCH, 6)))
               for s in range(STEPS)]
    return model, batches, _hf_loss


def hf_mixtral():
    """Mixture of experts: top-2 routing, the experts through torch's grouped matmul (transformers
    calls ``_grouped_mm`` on "tpu" tensors of any dtype), the router's load-balancing loss included."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    model = MixtralForCausalLM(cfg)
    batches = [dict(input_ids=_tokens(s), labels=_tokens(s)) for s in range(STEPS)]
    return model, batches, _hf_loss


def hf_swin():
    """A vision transformer with shifted windows: torch.roll, window partition views, relative
    position bias gathered by index, patch merging, layer norms."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                     window_size=4, num_labels=5, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = SwinForImageClassification(cfg)
    g = torch.Generator().manual_seed(7)
    batches = [dict(pixel_values=torch.randn(BATCH, 3, 32, 32, generator=g),
                    labels=torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(STEPS)]
    return model, batches, _hf_loss


HF_FAMILIES = {"hf_llama": hf_llama, "hf_gpt2": hf_gpt2, "hf_bert": hf_bert, "hf_t5": hf_t5,
               "hf_mixtral": hf_mixtral, "hf_swin": hf_swin}


# -- torch.nn families ----------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """A torchvision-style residual block: conv-bn-relu-conv-bn plus a projected shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layers = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _ce_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def resnet():
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4, 3, 16, 16, generator=g) * 2 + 1, torch.randint(0, 10, (4,), generator=g))
               for _ in range(STEPS)]
    return TinyResNet(), batches, _ce_loss


class LSTMLM(nn.Module):
    """An RNN language model: embedding, 2-layer LSTM, a GRU on top, and a tied output projection."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.gru = nn.GRU(24, 16, batch_first=True)
        self.out = nn.Linear(16, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        h, _ = self.lstm(self.embed(x))
        h, _ = self.gru(h)
        return self.out(h)


def _lm_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def lstm_lm():
    return LSTMLM(), [(_tokens(s), _tokens(50 + s)) for s in range(STEPS)], _lm_loss


TORCH_FAMILIES = {"resnet_bn": resnet, "lstm_lm": lstm_lm}
FAMILIES = {**HF_FAMILIES, **TORCH_FAMILIES}
