"""How a decoder reranker reads a (query, document) pair: its prompt template, the one place bouquet keeps it.
No torch, so the gateway uses it to tokenize; the replica never needs it.

An encoder cross-encoder pairs texts with its tokenizer's own pair template ([CLS] q [SEP] p [SEP]). A decoder
reranker was trained on a chat prompt instead: Qwen3-Reranker answers "yes" or "no" to

    <|im_start|>system
    Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the
    answer can only be "yes" or "no".<|im_end|>
    <|im_start|>user
    <Instruct>: {instruction}
    <Query>: {query}
    <Document>: {document}<|im_end|>
    <|im_start|>assistant
    <think>

    </think>

and its model card tokenizes the fixed prefix and suffix alone and the part between them as one text, truncated
from its end: a long document is cut first, the prefix and suffix always kept. The template is chosen by the
architecture a replica reports (a reranker's, served as a sequence classifier); a model that needs another one
is one more entry in `_TEMPLATES`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PairTemplate:
    prefix: str  # tokenized alone, before every pair
    body: str  # with {instruction}, {query} and {document}: tokenized as one text, truncated from its end
    suffix: str  # tokenized alone, after every pair
    default_instruction: str

    def format(self, query: str, document: str, instruction: str | None = None) -> str:
        """The part between prefix and suffix; `instruction` None: the model's default."""
        instruction = self.default_instruction if instruction is None else instruction
        return self.body.format(instruction=instruction, query=query, document=document)


QWEN3_RERANKER = PairTemplate(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
        'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    ),
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    default_instruction="Given a web search query, retrieve relevant passages that answer the query",
)

# A score model's architecture, as its replica reports it (model_dir.py serves a causal reranker as its family's
# sequence classifier), to the template its pairs are read through.
_TEMPLATES = {"Qwen3ForSequenceClassification": QWEN3_RERANKER}


def pair_template(architecture: str, task: str) -> PairTemplate | None:
    """The template a score model reads pairs through; None: its tokenizer pairs them."""
    return _TEMPLATES.get(architecture) if task == "score" else None
