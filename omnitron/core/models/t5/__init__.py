"""T5 (Megatron's pretrain_t5): encoder-decoder Transformer trained by span corruption."""
from omnitron.core.models.t5.config import (T5Config, decoder_layers, decoder_length, encoder_layers, num_parameters,
                                            t5_base, t5_tiny, validate_t5)
from omnitron.core.models.t5.model import T5DecoderLayer, T5Model

__all__ = ["T5Config", "T5Model", "T5DecoderLayer", "t5_tiny", "t5_base", "num_parameters", "validate_t5",
           "encoder_layers", "decoder_layers", "decoder_length"]
