"""Checkpoints: msgpack manifest of TensorProtos + safetensors buffers (see schema/README.md)."""

from .manifest import FORMAT, MANIFEST_NAME, VERSION, BufferEntry, Manifest, TensorEntry
from .reader import Checkpoint, load_quantized, open_checkpoint, read_protos, verify
from .writer import CheckpointWriter, parse_size, save_quantized

