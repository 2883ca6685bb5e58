# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT32: _ClassVar[Encoding]
    FLOAT16: _ClassVar[Encoding]
    BFLOAT16: _ClassVar[Encoding]
    INT8: _ClassVar[Encoding]
    UINT8: _ClassVar[Encoding]
    BINARY: _ClassVar[Encoding]
    UBINARY: _ClassVar[Encoding]
    UBINARY_LSB: _ClassVar[Encoding]
    FP8_E4M3: _ClassVar[Encoding]
    FP8_E5M2: _ClassVar[Encoding]
FLOAT32: Encoding
FLOAT16: Encoding
BFLOAT16: Encoding
INT8: Encoding
UINT8: Encoding
BINARY: Encoding
UBINARY: Encoding
UBINARY_LSB: Encoding
FP8_E4M3: Encoding
FP8_E5M2: Encoding

class EmbedRequest(_message.Message):
    __slots__ = ("input_ids", "cu_seqlens", "token_type_ids", "dimensions", "normalize", "prompt_tokens", "encoding", "sparse", "cu_spans", "span_bounds", "raw_spans", "token_vectors", "key_lens", "maxsim", "pixel_values", "image_shape", "all_outputs", "image_grid_thw", "cu_images")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TYPE_IDS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    CU_SPANS_FIELD_NUMBER: _ClassVar[int]
    SPAN_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    RAW_SPANS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VECTORS_FIELD_NUMBER: _ClassVar[int]
    KEY_LENS_FIELD_NUMBER: _ClassVar[int]
    MAXSIM_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ALL_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    CU_IMAGES_FIELD_NUMBER: _ClassVar[int]
    input_ids: bytes
    cu_seqlens: bytes
    token_type_ids: bytes
    dimensions: int
    normalize: bool
    prompt_tokens: int
    encoding: Encoding
    sparse: bool
    cu_spans: bytes
    span_bounds: bytes
    raw_spans: bool
    token_vectors: bool
    key_lens: bytes
    maxsim: bool
    pixel_values: bytes
    image_shape: _containers.RepeatedScalarFieldContainer[int]
    all_outputs: bool
    image_grid_thw: bytes
    cu_images: bytes
    def __init__(self, input_ids: _Optional[bytes] = ..., cu_seqlens: _Optional[bytes] = ..., token_type_ids: _Optional[bytes] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., sparse: _Optional[bool] = ..., cu_spans: _Optional[bytes] = ..., span_bounds: _Optional[bytes] = ..., raw_spans: _Optional[bool] = ..., token_vectors: _Optional[bool] = ..., key_lens: _Optional[bytes] = ..., maxsim: _Optional[bool] = ..., pixel_values: _Optional[bytes] = ..., image_shape: _Optional[_Iterable[int]] = ..., all_outputs: _Optional[bool] = ..., image_grid_thw: _Optional[bytes] = ..., cu_images: _Optional[bytes] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "num_seqs", "dimension", "encoding", "sparse_offsets", "sparse_indices", "sparse_values", "token_rows", "token_dimension")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SPARSE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_INDICES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    embeddings: bytes
    num_seqs: int
    dimension: int
    encoding: Encoding
    sparse_offsets: bytes
    sparse_indices: bytes
    sparse_values: bytes
    token_rows: bytes
    token_dimension: int
    def __init__(self, embeddings: _Optional[bytes] = ..., num_seqs: _Optional[int] = ..., dimension: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., sparse_offsets: _Optional[bytes] = ..., sparse_indices: _Optional[bytes] = ..., sparse_values: _Optional[bytes] = ..., token_rows: _Optional[bytes] = ..., token_dimension: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("include_tokenizer",)
    INCLUDE_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    include_tokenizer: bool
    def __init__(self, include_tokenizer: _Optional[bool] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "dimension", "max_seq_length", "pooling", "dtype", "device", "vocab_size", "prompts", "default_prompt_name", "max_batch_tokens", "tokenizer_json", "normalize", "family", "task", "score_activation", "sparse_dimension", "served_names", "multi_vector", "image_shape", "image_tokens", "image_processor_json", "image_patch_dim", "chat_template", "image_sequences", "image_max_patches", "logit_scale", "logit_bias", "wire_version", "bouquet_version", "lane_path", "lane_nonce", "st_messages")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SCORE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    SPARSE_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_NAMES_FIELD_NUMBER: _ClassVar[int]
    MULTI_VECTOR_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PROCESSOR_JSON_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PATCH_DIM_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_MAX_PATCHES_FIELD_NUMBER: _ClassVar[int]
    LOGIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BOUQUET_VERSION_FIELD_NUMBER: _ClassVar[int]
    LANE_PATH_FIELD_NUMBER: _ClassVar[int]
    LANE_NONCE_FIELD_NUMBER: _ClassVar[int]
    ST_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    dimension: int
    max_seq_length: int
    pooling: str
    dtype: str
    device: str
    vocab_size: int
    prompts: _containers.ScalarMap[str, str]
    default_prompt_name: str
    max_batch_tokens: int
    tokenizer_json: str
    normalize: bool
    family: str
    task: str
    score_activation: str
    sparse_dimension: int
    served_names: _containers.RepeatedScalarFieldContainer[str]
    multi_vector: MultiVector
    image_shape: _containers.RepeatedScalarFieldContainer[int]
    image_tokens: int
    image_processor_json: str
    image_patch_dim: int
    chat_template: str
    image_sequences: bool
    image_max_patches: int
    logit_scale: float
    logit_bias: float
    wire_version: int
    bouquet_version: str
    lane_path: str
    lane_nonce: str
    st_messages: StMessages
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., dimension: _Optional[int] = ..., max_seq_length: _Optional[int] = ..., pooling: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., prompts: _Optional[_Mapping[str, str]] = ..., default_prompt_name: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., tokenizer_json: _Optional[str] = ..., normalize: _Optional[bool] = ..., family: _Optional[str] = ..., task: _Optional[str] = ..., score_activation: _Optional[str] = ..., sparse_dimension: _Optional[int] = ..., served_names: _Optional[_Iterable[str]] = ..., multi_vector: _Optional[_Union[MultiVector, _Mapping]] = ..., image_shape: _Optional[_Iterable[int]] = ..., image_tokens: _Optional[int] = ..., image_processor_json: _Optional[str] = ..., image_patch_dim: _Optional[int] = ..., chat_template: _Optional[str] = ..., image_sequences: _Optional[bool] = ..., image_max_patches: _Optional[int] = ..., logit_scale: _Optional[float] = ..., logit_bias: _Optional[float] = ..., wire_version: _Optional[int] = ..., bouquet_version: _Optional[str] = ..., lane_path: _Optional[str] = ..., lane_nonce: _Optional[str] = ..., st_messages: _Optional[_Union[StMessages, _Mapping]] = ...) -> None: ...

class StMessages(_message.Message):
    __slots__ = ("generation_prompt", "flat", "special_tokens")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    FLAT_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    generation_prompt: bool
    flat: bool
    special_tokens: _containers.ScalarMap[str, str]
    def __init__(self, generation_prompt: _Optional[bool] = ..., flat: _Optional[bool] = ..., special_tokens: _Optional[_Mapping[str, str]] = ...) -> None: ...

class MultiVector(_message.Message):
    __slots__ = ("dimension", "query_prefix", "document_prefix", "query_length", "document_length", "expand_queries", "expansion_id", "attend_to_expansion", "skiplist", "skip_leading")
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    QUERY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    QUERY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EXPAND_QUERIES_FIELD_NUMBER: _ClassVar[int]
    EXPANSION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEND_TO_EXPANSION_FIELD_NUMBER: _ClassVar[int]
    SKIPLIST_FIELD_NUMBER: _ClassVar[int]
    SKIP_LEADING_FIELD_NUMBER: _ClassVar[int]
    dimension: int
    query_prefix: _containers.RepeatedScalarFieldContainer[int]
    document_prefix: _containers.RepeatedScalarFieldContainer[int]
    query_length: int
    document_length: int
    expand_queries: bool
    expansion_id: int
    attend_to_expansion: bool
    skiplist: _containers.RepeatedScalarFieldContainer[int]
    skip_leading: int
    def __init__(self, dimension: _Optional[int] = ..., query_prefix: _Optional[_Iterable[int]] = ..., document_prefix: _Optional[_Iterable[int]] = ..., query_length: _Optional[int] = ..., document_length: _Optional[int] = ..., expand_queries: _Optional[bool] = ..., expansion_id: _Optional[int] = ..., attend_to_expansion: _Optional[bool] = ..., skiplist: _Optional[_Iterable[int]] = ..., skip_leading: _Optional[int] = ...) -> None: ...
