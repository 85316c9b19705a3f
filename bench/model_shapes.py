"""Parameter shapes of two public models, as data, for bench.fusion_perf.

ResNet-50 (He et al. 2015, torchvision's layout): 161 tensors, 25,557,032
parameters. A 12-layer transformer encoder with BERT-base's sizes (Devlin et
al. 2018: hidden 768, 12 heads, feed-forward 3072, vocabulary 30,522, 512
positions) and its pooler: 199 tensors, 109,482,240 parameters. Both in
forward order (backward produces gradients in about the reverse order).
"""


def resnet50():
    """[(name, shape)] of ResNet-50's trainable parameters."""
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for block in range(blocks):
            prefix = f"layer{layer}.{block}"
            for i, (out_channels, in_channels, k) in enumerate(
                    ((planes, inplanes, 1), (planes, planes, 3), (4 * planes, planes, 1)), start=1):
                shapes += [(f"{prefix}.conv{i}.weight", (out_channels, in_channels, k, k)),
                           (f"{prefix}.bn{i}.weight", (out_channels,)), (f"{prefix}.bn{i}.bias", (out_channels,))]
            if block == 0:   # the projection shortcut
                shapes += [(f"{prefix}.downsample.0.weight", (4 * planes, inplanes, 1, 1)),
                           (f"{prefix}.downsample.1.weight", (4 * planes,)),
                           (f"{prefix}.downsample.1.bias", (4 * planes,))]
            inplanes = 4 * planes
    shapes += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return shapes


def transformer(layers=12, hidden=768, feed_forward=3072, vocabulary=30522, positions=512):
    """[(name, shape)] of a BERT-base-sized encoder (embeddings, layers, pooler)."""
    shapes = [("embeddings.word", (vocabulary, hidden)), ("embeddings.position", (positions, hidden)),
              ("embeddings.token_type", (2, hidden)),
              ("embeddings.norm.weight", (hidden,)), ("embeddings.norm.bias", (hidden,))]
    for layer in range(layers):
        p = f"layer{layer}"
        for name in ("query", "key", "value", "attention_output"):
            shapes += [(f"{p}.{name}.weight", (hidden, hidden)), (f"{p}.{name}.bias", (hidden,))]
        shapes += [(f"{p}.attention_norm.weight", (hidden,)), (f"{p}.attention_norm.bias", (hidden,)),
                   (f"{p}.intermediate.weight", (feed_forward, hidden)), (f"{p}.intermediate.bias", (feed_forward,)),
                   (f"{p}.output.weight", (hidden, feed_forward)), (f"{p}.output.bias", (hidden,)),
                   (f"{p}.output_norm.weight", (hidden,)), (f"{p}.output_norm.bias", (hidden,))]
    shapes += [("pooler.weight", (hidden, hidden)), ("pooler.bias", (hidden,))]
    return shapes


MODELS = {"resnet50": resnet50, "transformer": transformer}
