from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TCP: _ClassVar[Transport]
    UCX: _ClassVar[Transport]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_OP_UNSPECIFIED: _ClassVar[ReduceOp]
    SUM: _ClassVar[ReduceOp]
    AVG: _ClassVar[ReduceOp]
    MIN: _ClassVar[ReduceOp]
    MAX: _ClassVar[ReduceOp]
    PRODUCT: _ClassVar[ReduceOp]
    BAND: _ClassVar[ReduceOp]
    BOR: _ClassVar[ReduceOp]
    BXOR: _ClassVar[ReduceOp]

class OpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_KIND_UNSPECIFIED: _ClassVar[OpKind]
    ALL_REDUCE: _ClassVar[OpKind]
    BROADCAST: _ClassVar[OpKind]
    REDUCE: _ClassVar[OpKind]
    ALL_GATHER: _ClassVar[OpKind]
    REDUCE_SCATTER: _ClassVar[OpKind]
    ALL_TO_ALL: _ClassVar[OpKind]
    GATHER: _ClassVar[OpKind]
    SCATTER: _ClassVar[OpKind]
    BARRIER: _ClassVar[OpKind]
    SEND: _ClassVar[OpKind]
    RECV: _ClassVar[OpKind]

class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_KIND_UNSPECIFIED: _ClassVar[ErrorKind]
    INVALID: _ClassVar[ErrorKind]
    MISMATCH: _ClassVar[ErrorKind]
    RANK_FAILED: _ClassVar[ErrorKind]
    TIMEOUT: _ClassVar[ErrorKind]
    UNAUTHENTICATED: _ClassVar[ErrorKind]
    SHUTDOWN: _ClassVar[ErrorKind]
    ABORTED: _ClassVar[ErrorKind]
TRANSPORT_UNSPECIFIED: Transport
TCP: Transport
UCX: Transport
DTYPE_UNSPECIFIED: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT32: DType
FLOAT64: DType
INT8: DType
UINT8: DType
INT16: DType
INT32: DType
INT64: DType
BOOL: DType
REDUCE_OP_UNSPECIFIED: ReduceOp
SUM: ReduceOp
AVG: ReduceOp
MIN: ReduceOp
MAX: ReduceOp
PRODUCT: ReduceOp
BAND: ReduceOp
BOR: ReduceOp
BXOR: ReduceOp
OP_KIND_UNSPECIFIED: OpKind
ALL_REDUCE: OpKind
BROADCAST: OpKind
REDUCE: OpKind
ALL_GATHER: OpKind
REDUCE_SCATTER: OpKind
ALL_TO_ALL: OpKind
GATHER: OpKind
SCATTER: OpKind
BARRIER: OpKind
SEND: OpKind
RECV: OpKind
ERROR_KIND_UNSPECIFIED: ErrorKind
INVALID: ErrorKind
MISMATCH: ErrorKind
RANK_FAILED: ErrorKind
TIMEOUT: ErrorKind
UNAUTHENTICATED: ErrorKind
SHUTDOWN: ErrorKind
ABORTED: ErrorKind

class PeerRequest(_message.Message):
    __slots__ = ("job_id", "comm_id", "node", "proof")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    comm_id: str
    node: int
    proof: bytes
    def __init__(self, job_id: _Optional[str] = ..., comm_id: _Optional[str] = ..., node: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("peer", "node_ids", "transport", "excluded_ranks", "exchange")
    PEER_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_RANKS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    peer: PeerRequest
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    transport: Transport
    excluded_ranks: _containers.RepeatedScalarFieldContainer[int]
    exchange: str
    def __init__(self, peer: _Optional[_Union[PeerRequest, _Mapping]] = ..., node_ids: _Optional[_Iterable[str]] = ..., transport: _Optional[_Union[Transport, str]] = ..., excluded_ranks: _Optional[_Iterable[int]] = ..., exchange: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("node_id", "data_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_port: int
    def __init__(self, node_id: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("peer", "kind", "message", "failed_ranks")
    PEER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FAILED_RANKS_FIELD_NUMBER: _ClassVar[int]
    peer: PeerRequest
    kind: ErrorKind
    message: str
    failed_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, peer: _Optional[_Union[PeerRequest, _Mapping]] = ..., kind: _Optional[_Union[ErrorKind, str]] = ..., message: _Optional[str] = ..., failed_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("failed_ranks",)
    FAILED_RANKS_FIELD_NUMBER: _ClassVar[int]
    failed_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, failed_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerStatusRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: PeerRequest
    def __init__(self, peer: _Optional[_Union[PeerRequest, _Mapping]] = ...) -> None: ...

class PeerStatusReply(_message.Message):
    __slots__ = ("node_id", "comm")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    comm: CommStatus
    def __init__(self, node_id: _Optional[str] = ..., comm: _Optional[_Union[CommStatus, _Mapping]] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("job_id", "job_token", "rank", "world_size", "root", "root_node_id", "timeout_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    ROOT_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_token: bytes
    rank: int
    world_size: int
    root: str
    root_node_id: str
    timeout_ms: int
    def __init__(self, job_id: _Optional[str] = ..., job_token: _Optional[bytes] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., root: _Optional[str] = ..., root_node_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class RendezvousReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSpec]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeSpec, _Mapping]]] = ...) -> None: ...

class MeetRequest(_message.Message):
    __slots__ = ("job_id", "proof", "rank", "world_size", "node_id", "peer_address", "timeout_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    proof: bytes
    rank: int
    world_size: int
    node_id: str
    peer_address: str
    timeout_ms: int
    def __init__(self, job_id: _Optional[str] = ..., proof: _Optional[bytes] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("job_id", "job_token", "comm_id", "rank", "world_size", "global_rank", "node_id", "pid", "arena_bytes", "timeout_ms", "nodes", "parent_comm_id", "excluded_ranks", "generation", "joined_ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    PARENT_COMM_ID_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_RANKS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_token: bytes
    comm_id: str
    rank: int
    world_size: int
    global_rank: int
    node_id: str
    pid: int
    arena_bytes: int
    timeout_ms: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSpec]
    parent_comm_id: str
    excluded_ranks: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., job_token: _Optional[bytes] = ..., comm_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., global_rank: _Optional[int] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., arena_bytes: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeSpec, _Mapping]]] = ..., parent_comm_id: _Optional[str] = ..., excluded_ranks: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ..., joined_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class NodeSpec(_message.Message):
    __slots__ = ("node_id", "peer_address", "ranks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("node_id", "peer_address", "version", "peer_transport", "data_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    version: str
    peer_transport: Transport
    data_port: int
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., version: _Optional[str] = ..., peer_transport: _Optional[_Union[Transport, str]] = ..., data_port: _Optional[int] = ...) -> None: ...

class TopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Device(_message.Message):
    __slots__ = ("kind", "index", "name")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    kind: str
    index: int
    name: str
    def __init__(self, kind: _Optional[str] = ..., index: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class JobLayout(_message.Message):
    __slots__ = ("job_id", "comm_id", "nodes", "local_ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    comm_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSpec]
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., comm_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeSpec, _Mapping]]] = ..., local_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class TopologyReply(_message.Message):
    __slots__ = ("node_id", "peer_address", "cpu_count", "devices", "jobs", "peer_transport", "data_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    PEER_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    cpu_count: int
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    jobs: _containers.RepeatedCompositeFieldContainer[JobLayout]
    peer_transport: Transport
    data_port: int
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., cpu_count: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobLayout, _Mapping]]] = ..., peer_transport: _Optional[_Union[Transport, str]] = ..., data_port: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("session_id", "session_secret", "chunk_bytes", "daemon_node_id", "daemon_version", "node_region")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_REGION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    chunk_bytes: int
    daemon_node_id: str
    daemon_version: str
    node_region: bool
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ..., chunk_bytes: _Optional[int] = ..., daemon_node_id: _Optional[str] = ..., daemon_version: _Optional[str] = ..., node_region: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("session_id", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class SegmentFree(_message.Message):
    __slots__ = ("alloc_base", "nbytes", "seq", "wait_ms")
    ALLOC_BASE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    alloc_base: int
    nbytes: int
    seq: int
    wait_ms: int
    def __init__(self, alloc_base: _Optional[int] = ..., nbytes: _Optional[int] = ..., seq: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class SegmentFreeReply(_message.Message):
    __slots__ = ("seq", "closed", "deferred", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    closed: int
    deferred: int
    error: str
    def __init__(self, seq: _Optional[int] = ..., closed: _Optional[int] = ..., deferred: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("offset", "nbytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class OpRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "session_secret", "seq", "part", "parts", "kind", "dtype", "count", "root", "reduce_op", "tag", "input", "output", "send_blocks", "recv_blocks", "direct", "cuda", "node_combined", "any_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SEND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    NODE_COMBINED_FIELD_NUMBER: _ClassVar[int]
    ANY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    session_id: str
    session_secret: bytes
    seq: int
    part: int
    parts: int
    kind: OpKind
    dtype: DType
    count: int
    root: int
    reduce_op: ReduceOp
    tag: int
    input: Region
    output: Region
    send_blocks: _containers.RepeatedCompositeFieldContainer[Region]
    recv_blocks: _containers.RepeatedCompositeFieldContainer[Region]
    direct: bool
    cuda: CudaOp
    node_combined: bool
    any_source: bool
    def __init__(self, request_id: _Optional[int] = ..., session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ..., seq: _Optional[int] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., kind: _Optional[_Union[OpKind, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., count: _Optional[int] = ..., root: _Optional[int] = ..., reduce_op: _Optional[_Union[ReduceOp, str]] = ..., tag: _Optional[int] = ..., input: _Optional[_Union[Region, _Mapping]] = ..., output: _Optional[_Union[Region, _Mapping]] = ..., send_blocks: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., recv_blocks: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., direct: _Optional[bool] = ..., cuda: _Optional[_Union[CudaOp, _Mapping]] = ..., node_combined: _Optional[bool] = ..., any_source: _Optional[bool] = ...) -> None: ...

class CudaBuffer(_message.Message):
    __slots__ = ("ipc_handle", "alloc_base", "alloc_bytes", "offset", "nbytes", "buffer_id")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_BASE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    alloc_base: int
    alloc_bytes: int
    offset: int
    nbytes: int
    buffer_id: int
    def __init__(self, ipc_handle: _Optional[bytes] = ..., alloc_base: _Optional[int] = ..., alloc_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., buffer_id: _Optional[int] = ...) -> None: ...

class CudaOp(_message.Message):
    __slots__ = ("device_uuid", "ready_event", "done_event", "inputs", "outputs", "freed")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: bytes
    ready_event: bytes
    done_event: bytes
    inputs: _containers.RepeatedCompositeFieldContainer[CudaBuffer]
    outputs: _containers.RepeatedCompositeFieldContainer[CudaBuffer]
    freed: _containers.RepeatedCompositeFieldContainer[CudaBuffer]
    def __init__(self, device_uuid: _Optional[bytes] = ..., ready_event: _Optional[bytes] = ..., done_event: _Optional[bytes] = ..., inputs: _Optional[_Iterable[_Union[CudaBuffer, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[CudaBuffer, _Mapping]]] = ..., freed: _Optional[_Iterable[_Union[CudaBuffer, _Mapping]]] = ...) -> None: ...

class OpReply(_message.Message):
    __slots__ = ("request_id", "ok", "error_kind", "error", "source_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    ok: bool
    error_kind: ErrorKind
    error: str
    source_rank: int
    def __init__(self, request_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error_kind: _Optional[_Union[ErrorKind, str]] = ..., error: _Optional[str] = ..., source_rank: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("session_id", "session_secret", "shrink", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    SHRINK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    shrink: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ..., shrink: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PendingOp(_message.Message):
    __slots__ = ("seq", "part", "description", "arrived_ranks", "missing_ranks", "waited_seconds")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_RANKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    part: int
    description: str
    arrived_ranks: _containers.RepeatedScalarFieldContainer[int]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    waited_seconds: float
    def __init__(self, seq: _Optional[int] = ..., part: _Optional[int] = ..., description: _Optional[str] = ..., arrived_ranks: _Optional[_Iterable[int]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., waited_seconds: _Optional[float] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "global_rank", "pid", "node_id", "attached", "ops_completed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    OPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    global_rank: int
    pid: int
    node_id: str
    attached: bool
    ops_completed: int
    def __init__(self, rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., pid: _Optional[int] = ..., node_id: _Optional[str] = ..., attached: _Optional[bool] = ..., ops_completed: _Optional[int] = ...) -> None: ...

class CommStatus(_message.Message):
    __slots__ = ("job_id", "comm_id", "world_size", "ranks", "pending", "failed", "ops_completed", "algorithms", "generation", "parent_comm_id", "excluded_ranks", "failed_ranks", "joined_ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    OPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ALGORITHMS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARENT_COMM_ID_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_RANKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_RANKS_FIELD_NUMBER: _ClassVar[int]
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    comm_id: str
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    pending: _containers.RepeatedCompositeFieldContainer[PendingOp]
    failed: str
    ops_completed: int
    algorithms: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    parent_comm_id: str
    excluded_ranks: _containers.RepeatedScalarFieldContainer[int]
    failed_ranks: _containers.RepeatedScalarFieldContainer[int]
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., comm_id: _Optional[str] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., pending: _Optional[_Iterable[_Union[PendingOp, _Mapping]]] = ..., failed: _Optional[str] = ..., ops_completed: _Optional[int] = ..., algorithms: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ..., parent_comm_id: _Optional[str] = ..., excluded_ranks: _Optional[_Iterable[int]] = ..., failed_ranks: _Optional[_Iterable[int]] = ..., joined_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node_id", "version", "uptime_seconds", "comms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    uptime_seconds: float
    comms: _containers.RepeatedCompositeFieldContainer[CommStatus]
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., comms: _Optional[_Iterable[_Union[CommStatus, _Mapping]]] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("exposition",)
    EXPOSITION_FIELD_NUMBER: _ClassVar[int]
    exposition: str
    def __init__(self, exposition: _Optional[str] = ...) -> None: ...

class FailureRequest(_message.Message):
    __slots__ = ("session_id", "session_secret", "wait_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    wait_ms: int
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class FailureReply(_message.Message):
    __slots__ = ("failed", "kind", "message", "failed_ranks", "generation", "agreed")
    FAILED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FAILED_RANKS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    failed: bool
    kind: ErrorKind
    message: str
    failed_ranks: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    agreed: bool
    def __init__(self, failed: _Optional[bool] = ..., kind: _Optional[_Union[ErrorKind, str]] = ..., message: _Optional[str] = ..., failed_ranks: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ..., agreed: _Optional[bool] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("session_id", "session_secret", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class RevokeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
