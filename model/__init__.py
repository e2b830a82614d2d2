"""BERT in plain PyTorch: config presets, encoder, heads, Hugging Face / Google checkpoint import-export.
No Ray, no DeepSpeed, no I/O beyond checkpoint files."""

from bertpipe.model.bert import (BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
                                 BertForTokenClassification, BertModel, ClassifierOutput, EncoderOutput,
                                 PreTrainingOutput, SpanOutput)
from bertpipe.model.hf_format import hf_state_dict, load_google_tf_arrays, load_pretrained, save_pretrained
from bertpipe.model.config import PRESETS, BertConfig

__all__ = ["BertConfig", "PRESETS", "BertModel", "EncoderOutput", "BertForPreTraining", "PreTrainingOutput",
           "ClassifierOutput", "SpanOutput",
           "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
           "save_pretrained", "load_pretrained", "hf_state_dict", "load_google_tf_arrays"]
