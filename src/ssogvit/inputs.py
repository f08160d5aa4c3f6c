"""One way in, under the name the README gives it: the names of `ssogvit.specs` (argument specs, `@checked`, the
shared declarations such as `IMG_SIZE`), `ssogvit.documents` (input paths, documents from disk),
`ssogvit.resources` (memory, devices) and the input errors of `ssogvit.errors`, re-exported. The code imports them
from where they are defined (docs/DEVELOPING.md, "Package layout")."""

from ssogvit.documents import (
    MAX_DOCUMENT_BYTES,
    MAX_PARAMETERS,
    MAX_YAML_ALIASES,
    DocumentError,
    check_no_interpolation,
    input_file,
    input_folder,
    parse_document,
    read_document,
)
from ssogvit.errors import InputError, InputTypeError
from ssogvit.resources import MemoryLimitError, check_device, check_memory, format_bytes, memory_limit
from ssogvit.specs import (
    BATCH_SIZE,
    DEPTH,
    DROP_RATE,
    EMBED_DIM,
    IMG_SIZE,
    IN_CHANS,
    MLP_RATIO,
    NUM_CLASSES,
    NUM_HEADS,
    NUM_REGISTERS,
    NUM_WORKERS,
    PATCH_SIZE,
    SEED,
    Choice,
    Flag,
    Float,
    Int,
    IntOrPair,
    Ints,
    Spec,
    Text,
    check_args,
    checked,
)

__all__ = [
    "InputError", "InputTypeError", "DocumentError", "MemoryLimitError",
    "Spec", "Int", "Float", "Choice", "Flag", "Text", "IntOrPair", "Ints", "checked", "check_args",
    "input_file", "input_folder", "check_device",
    "memory_limit", "check_memory", "format_bytes",
    "read_document", "parse_document", "check_no_interpolation",
    "MAX_DOCUMENT_BYTES", "MAX_YAML_ALIASES", "MAX_PARAMETERS",
    "IMG_SIZE", "PATCH_SIZE", "BATCH_SIZE", "NUM_CLASSES", "IN_CHANS", "NUM_WORKERS", "SEED",
    "EMBED_DIM", "NUM_HEADS", "DEPTH", "MLP_RATIO", "NUM_REGISTERS", "DROP_RATE",
]
