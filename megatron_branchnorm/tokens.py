"""Special token ids shared by the model, the data pipeline and the exporters.

The SentencePiece model is trained with these ids (tools/preprocess_data.py), and the model's
padding, decoder start and end-of-sentence follow them. Target-language tags ``<2xx>`` are
SentencePiece user symbols placed right after them.

    source:             <2yy> x_1 ... x_n </s>
    prev_output_tokens: <s> y_1 ... y_m
    target:             y_1 ... y_m </s>
"""

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"

SPM_SPECIALS = {
    "pad_id": PAD_ID,
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "pad_piece": PAD,
    "unk_piece": UNK,
    "bos_piece": BOS,
    "eos_piece": EOS,
}
"""SentencePieceTrainer.train arguments that give the special pieces our ids."""


def lang_tag(lang: str) -> str:
    """The target-language tag token for ``lang`` (e.g. ``<2de>``)."""
    return f"<2{lang}>"
