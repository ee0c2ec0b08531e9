"""BERT (Megatron's pretrain_bert): bidirectional encoder, masked-LM and binary (NSP/SOP) heads."""
from omnitron.core.models.bert.config import BertConfig, bert_base, bert_tiny, num_parameters, validate_bert
from omnitron.core.models.bert.model import BertModel, bert_loss

__all__ = ["BertConfig", "BertModel", "bert_loss", "bert_tiny", "bert_base", "num_parameters", "validate_bert"]
