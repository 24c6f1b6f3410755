"""Models from Hugging Face transformers, built from their config classes with random weights
(nothing is downloaded: HF_HUB_OFFLINE=1), small enough that an export and a gradient check take
seconds. Each takes token ids (batch, 12) from a 1,000-token vocabulary (the audio classifier:
400 raw samples) and returns logits: sequence classifiers 10 classes, language models the
vocabulary.

Dropout is 0 in every config: the gradient checks compare against PyTorch's autograd, whose
masks are its own (the import's dropout is tested on the project's own zoo)."""

from __future__ import annotations

import os

import torch.nn as nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ = 1000, 12
AUDIO = 400   # raw samples of the audio classifier
SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64)


class Logits(nn.Module):
    """`model(input_ids=x).logits`: the one tensor output an export needs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(input_ids=x).logits


class AudioLogits(nn.Module):
    """`model(input_values=x).logits` for an audio classifier fed raw samples."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(input_values=x).logits


def bert():
    import transformers as t
    return t.BertForSequenceClassification(t.BertConfig(
        **SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def distilbert():
    import transformers as t
    return t.DistilBertForSequenceClassification(t.DistilBertConfig(
        **SMALL, dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=10, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0))


def gpt2():
    import transformers as t
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama():
    import transformers as t
    return t.LlamaForCausalLM(t.LlamaConfig(
        **SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, attention_dropout=0.0))


def roberta():
    """Position ids from the token ids at run time (a running sum of the non-padding mask)."""
    import transformers as t
    return t.RobertaForSequenceClassification(t.RobertaConfig(
        **SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def bart():
    """Encoder-decoder: the decoder reads the token ids shifted right (scatters at run time),
    the head pools at the last end-of-sequence token (NonZero)."""
    import transformers as t
    return t.BartForSequenceClassification(t.BartConfig(
        **SMALL, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_labels=10, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, classifier_dropout=0.0))


def t5():
    """Relative position buckets, the decoder ids shifted right and pooling at the end-of-sequence
    token, as BART."""
    import transformers as t
    return t.T5ForSequenceClassification(t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, num_labels=10,
        dropout_rate=0.0, classifier_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def qwen2_cls():
    """A decoder-only sequence classifier (transformers' generic head, as Llama's and Mistral's):
    it pools at each row's last non-padding token, found at run time by an ArgMax over the
    positions times the mask, and picked per row by index. Grouped-query attention: PyTorch's
    TorchScript exporter cannot write it."""
    import transformers as t
    return t.Qwen2ForSequenceClassification(t.Qwen2Config(
        **SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_labels=10, pad_token_id=PAD, attention_dropout=0.0))


def llama_cls():
    """The same head on Llama, one key-value head per query head (both exporters write it)."""
    import transformers as t
    return t.LlamaForSequenceClassification(t.LlamaConfig(
        **SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, num_labels=10, pad_token_id=PAD, attention_dropout=0.0))


def mistral_cls():
    """The same head on Mistral (grouped-query attention: dynamo only)."""
    import transformers as t
    return t.MistralForSequenceClassification(t.MistralConfig(
        **SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_labels=10, pad_token_id=PAD, attention_dropout=0.0))


def deberta():
    """DeBERTa-v2: log-bucketed relative positions (Sign) and their keys and queries repeated per
    sample (Tile by the batch size), gathered per score (GatherElements)."""
    import transformers as t
    return t.DebertaV2ForSequenceClassification(t.DebertaV2Config(
        **SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0,
        relative_attention=True, position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"]))


def wav2vec2():
    """An audio encoder: a convolutional feature extractor whose first layer has GroupNorm (one
    group per channel: InstanceNormalization in both exporters), a weight-normed convolutional
    position embedding, then a transformer; fed 400 raw samples."""
    import transformers as t
    return t.Wav2Vec2ForSequenceClassification(t.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), feat_extract_norm="group", num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_labels=10, classifier_proj_size=16, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        apply_spec_augment=False, mask_time_prob=0.0))   # no SpecAugment: no masked_spec_embed


# The padding token of the decoder-only classifiers; their sample rows end in it, row r in r of
# them (row 0 in none), so that each row pools at a position of its own.
PAD = 0
PADDED = ("qwen2_cls", "llama_cls", "mistral_cls")

# The end-of-sequence token of the models that pool at it: every row must hold it equally often
# (the models raise otherwise), as a tokenizer writes it, once and last.
END_OF_SEQUENCE = {"bart": 2, "t5": 1}


def end_sequences(name: str, tokens):
    """Token ids for model ``name`` as a tokenizer ends them: the end-of-sequence token once
    per row, last, or a decoder-only classifier's padding (``PADDED``); unchanged for the
    others."""
    if name in PADDED:
        tokens = tokens.masked_fill(tokens == PAD, PAD + 1)
        for r in range(1, tokens.shape[0]):
            tokens[r, tokens.shape[1] - min(r, tokens.shape[1] - 1):] = PAD
        return tokens
    eos = END_OF_SEQUENCE.get(name)
    if eos is None:
        return tokens
    tokens = tokens.masked_fill(tokens == eos, eos + 1)
    tokens[:, -1] = eos
    return tokens


# name -> (constructor of the wrapped model, one sample's input shape, token vocabulary), as
# onnx_zoo.ZOO
HF_ZOO = {name: (lambda build=build: Logits(build()), (SEQ,), VOCAB)
          for name, build in (("bert", bert), ("distilbert", distilbert), ("gpt2", gpt2), ("llama", llama),
                              ("roberta", roberta), ("bart", bart), ("t5", t5), ("qwen2_cls", qwen2_cls),
                              ("llama_cls", llama_cls), ("mistral_cls", mistral_cls), ("deberta", deberta))}
HF_ZOO["wav2vec2"] = (lambda: AudioLogits(wav2vec2()), (AUDIO,), None)
