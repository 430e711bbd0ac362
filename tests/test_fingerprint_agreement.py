"""The decoder's own fingerprint equals the encoder's, so it can refuse keys of other weights."""

from __future__ import annotations

import pytest
import torch

from pipeline.families import adapter_for
from pipeline.fingerprint import expected_fingerprint, model_fingerprint


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_decoder_and_encoder_agree_on_the_fingerprint(family, tiny_checkpoint):
    checkpoint = tiny_checkpoint(family)
    encoder = adapter_for(checkpoint)
    encoder.load_vision(device="cpu", dtype=None)  # as VisionEncoder with dtype auto
    encoder_fp = model_fingerprint(encoder, {"dtype": str(next(encoder.vision.parameters()).dtype)})

    decoder = adapter_for(checkpoint)
    assert expected_fingerprint(decoder, decoder.vision_dtype) == encoder_fp
    assert decoder.vision is None  # the weights are dropped again
    other = torch.bfloat16 if decoder.vision_dtype != torch.bfloat16 else torch.float32
    assert expected_fingerprint(decoder, other) != encoder_fp
