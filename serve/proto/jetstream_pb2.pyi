from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("max_tokens", "text_content", "token_content", "metadata", "num_samples", "lora_adapter_id")
    class TextContent(_message.Message):
        __slots__ = ("text",)
        TEXT_FIELD_NUMBER: _ClassVar[int]
        text: str
        def __init__(self, text: _Optional[str] = ...) -> None: ...
    class TokenContent(_message.Message):
        __slots__ = ("token_ids",)
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    class Metadata(_message.Message):
        __slots__ = ("start_time",)
        START_TIME_FIELD_NUMBER: _ClassVar[int]
        start_time: float
        def __init__(self, start_time: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CONTENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    text_content: DecodeRequest.TextContent
    token_content: DecodeRequest.TokenContent
    metadata: DecodeRequest.Metadata
    num_samples: int
    lora_adapter_id: str
    def __init__(self, max_tokens: _Optional[int] = ..., text_content: _Optional[_Union[DecodeRequest.TextContent, _Mapping]] = ..., token_content: _Optional[_Union[DecodeRequest.TokenContent, _Mapping]] = ..., metadata: _Optional[_Union[DecodeRequest.Metadata, _Mapping]] = ..., num_samples: _Optional[int] = ..., lora_adapter_id: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("initial_content", "stream_content")
    class InitialContent(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class StreamContent(_message.Message):
        __slots__ = ("samples",)
        class Sample(_message.Message):
            __slots__ = ("text", "token_ids")
            TEXT_FIELD_NUMBER: _ClassVar[int]
            TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
            text: str
            token_ids: _containers.RepeatedScalarFieldContainer[int]
            def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
        SAMPLES_FIELD_NUMBER: _ClassVar[int]
        samples: _containers.RepeatedCompositeFieldContainer[DecodeResponse.StreamContent.Sample]
        def __init__(self, samples: _Optional[_Iterable[_Union[DecodeResponse.StreamContent.Sample, _Mapping]]] = ...) -> None: ...
    INITIAL_CONTENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_CONTENT_FIELD_NUMBER: _ClassVar[int]
    initial_content: DecodeResponse.InitialContent
    stream_content: DecodeResponse.StreamContent
    def __init__(self, initial_content: _Optional[_Union[DecodeResponse.InitialContent, _Mapping]] = ..., stream_content: _Optional[_Union[DecodeResponse.StreamContent, _Mapping]] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("is_live",)
    IS_LIVE_FIELD_NUMBER: _ClassVar[int]
    is_live: bool
    def __init__(self, is_live: _Optional[bool] = ...) -> None: ...
