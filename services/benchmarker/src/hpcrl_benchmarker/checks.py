"""Source and object checks: techniques used (stages), forbidden calls (library violations).

Source checks read code only (comments and string literals blanked) and run on both the
completion and the main-file part of its preprocessor output, so a technique or a call
hidden behind a macro or token pasting is still seen. The object check is the real gate:
every undefined symbol of the compiled kernel must be on an allow-list, the object may
not define symbols of the C or OpenMP runtime nor code that runs outside the kernel call,
and nothing but compiled functions may be executable.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from hpcrl_benchmarker.cscan import attributes, pragma_text
from hpcrl_common.csource import blank_comments_and_literals, code_tokens, unreadable
from hpcrl_common.stages import CACHE_BLOCKING, OPENMP, PREFETCH, REGISTER_BLOCKING, SIMD

_SIMD_CODE = re.compile(
    r"\b(_mm\d*_\w+|_m_\w+|__m(64|128|256|512)[dhi]?\w*|__builtin_ia32_\w+|__v\d+[a-z]+\w*)\b"
    r"|\b_*vector_size_*\b|\b__builtin_shufflevector\b|\b__builtin_convertvector\b"
)
# Helpers named like intrinsics that vectorise nothing: aligned allocation, the MXCSR (FTZ/DAZ
# modes), the spin-wait hint.
_NOT_SIMD = frozenset({"_mm_malloc", "_mm_free", "_mm_setcsr", "_mm_getcsr", "_mm_pause"})
# Attributes that make vectors or vector functions: vector_size, a vector machine mode
# (mode(V4DF)), and simd (a vector variant of a function, like `omp declare simd`).
_SIMD_ATTRIBUTES = frozenset({"vector_size", "simd"})
_VECTOR_MODE = re.compile(r"^\s*_*V\d+[A-Z]+")
_SIMD_PRAGMA = re.compile(
    r"^(omp\b.*\bsimd\b|GCC\s+ivdep\b|ivdep\b|clang\s+loop\s+vectorize|vector\b|simd\b"
    r"|GCC\s+optimize\b.*vectori[sz]e)"
)
_OPENMP_CODE = re.compile(r"\b(omp_|GOMP_)\w+\s*\(|\b(pthread_create|thrd_create)\b")
_PREFETCH_CODE = re.compile(
    r"\b(_mm_prefetch|_m_prefetch\w*|_mm512_\w*prefetch\w*|__builtin_prefetch|prefetch[tw]\w*"
    r"|__builtin_ia32_(gather|scatter)pf\w*)\b"
)
# Every pattern here runs on untrusted text of up to a megabyte in this process: each must
# take linear time (bounded repeats where a match could otherwise rescan the rest).
# A tile's end clamped to the matrix: `if (i_end > M) i_end = M;` (as well as min() or ?:).
_CLAMP = re.compile(
    r"\bif\s{0,40}\(\s{0,40}(\w{1,64})\s{0,40}>\s{0,40}\w{1,64}\s{0,40}\)"
    r"\s{0,40}\1\s{0,40}=\s{0,40}\w{1,64}\s{0,40};"
)
_FOR_STEP = re.compile(
    r"\bfor\s*\([^;]{0,400};[^;]{0,400};\s*\w+\s*(\+=|=\s*\w+\s*\+)\s*(\w+)\s*\)"
)


def detect_techniques(source: str, preprocessed_main: str = "") -> set[str]:
    """The optimisation techniques the code uses (the names of docs/SPEC.md Table I)."""
    found: set[str] = set()
    for text in (source, preprocessed_main):
        if not text:
            continue
        code = blank_comments_and_literals(text)
        pragmas = pragma_text(code) + _pragma_operators(text)
        attrs = attributes(code)
        # OpenMP directives as attributes ([[omp::directive(...)]]) read like pragmas.
        pragmas += [f"omp {args}" for namespace, _, args in attrs if namespace == "omp"]
        if (
            _simd_code(code)
            or any(_SIMD_PRAGMA.match(p) for p in pragmas)
            or _simd_attribute(attrs)
        ):
            found.add(SIMD)
        omp_pragmas = [p for p in pragmas if p.startswith("omp")]
        if _OPENMP_CODE.search(code) or any(not _simd_only(p) for p in omp_pragmas):
            found.add(OPENMP)
        if _PREFETCH_CODE.search(code):
            found.add(PREFETCH)
        found |= _blocking(code)
    return found


def object_techniques(undefined: Iterable[str]) -> set[str]:
    """Techniques the compiled object shows whatever the source looked like: any call into
    the OpenMP runtime (pragmas, ``omp_*``, or ``GOMP_*`` entry points called by hand)."""
    return {OPENMP} if any(n.startswith(("GOMP_", "omp_")) for n in undefined) else set()


def _pragma_operators(text: str) -> list[str]:
    """The operand of every ``_Pragma`` operator (a string literal, which blanking empties),
    read from gcc's tokens: any prefix (``L"..."``), splices and comments between the tokens,
    escapes undone as gcc destringizes it."""
    found = []
    tokens = list(code_tokens(text))
    for index, (kind, spelling) in enumerate(tokens[:-2]):
        if kind != "identifier" or spelling != "_Pragma" or tokens[index + 1][1] != "(":
            continue
        operand_kind, operand = tokens[index + 2]
        if operand_kind != "string":
            continue
        body = operand[operand.index('"') + 1 :]
        body = body[:-1] if body.endswith('"') else body
        body = re.sub(r'\\([\\"])', r"\1", body)
        found.append(" ".join(body.split()))
    return found


def _simd_code(code: str) -> bool:
    return any(m.group(0) not in _NOT_SIMD for m in _SIMD_CODE.finditer(code))


def _simd_attribute(attrs: list[tuple[str, str, str]]) -> bool:
    return any(
        name in _SIMD_ATTRIBUTES or (name == "mode" and _VECTOR_MODE.match(args))
        for _, name, args in attrs
    )


def _simd_only(pragma: str) -> bool:
    words = pragma.split()
    return words[:2] == ["omp", "simd"] or words[:3] == ["omp", "declare", "simd"]


def _blocking(code: str) -> set[str]:
    """Heuristic and informative only (blocking is allowed from stage 1/2 and not policed)."""
    found = set()
    steps = [m.group(2) for m in _FOR_STEP.finditer(code)]
    if any(not s.isdigit() or int(s) >= 16 for s in steps) and (
        re.search(r"\bmin\w*\s*\(|\?", code) or _CLAMP.search(code)
    ):
        found.add(CACHE_BLOCKING)
    if any(s.isdigit() and 2 <= int(s) <= 16 for s in steps) or re.search(
        r"\b(c|acc|sum)_?\d{1,4}_?\d{1,4}\b", code
    ):
        found.add(REGISTER_BLOCKING)
    return found


# --- library violations: source ------------------------------------------------------------

_FORBIDDEN_CALLS = (
    r"cblas_\w+|[sdcz]gemm_?|[sdcz]gemv_?|[sdcz]axpy_|[sdcz]dot_|mkl_\w+|openblas_\w+|"
    r"bli_\w+|LAPACKE_\w+|"
    r"dlopen|dlsym|dlmopen|dlvsym|system|popen|exec[lv]p?e?|fexecve|fork|vfork|clone\d?|"
    r"posix_spawnp?|socket|connect|bind|accept|sendto|recvfrom|fopen|freopen|fdopen|open|"
    r"openat|creat|syscall|ptrace|kill|raise|signal|sigaction|setjmp|_setjmp|sigsetjmp|"
    r"longjmp|siglongjmp|pthread_\w+|thrd_\w+|getenv|secure_getenv|mprotect|mmap|"
    r"__builtin_frame_address|__builtin_return_address|__builtin_longjmp|__builtin_setjmp"
)
_FORBIDDEN_CALL_RE = re.compile(r"\b(" + _FORBIDDEN_CALLS + r")\s*\(")
_ASM_RE = re.compile(r"\b(asm|__asm__|__asm)\b")
_INCLUDE = re.compile(r"^[ \t]*(?:#|%:)[ \t]*include[ \t]*[<\"]([^>\"\n]*)[>\"]", re.MULTILINE)
_FORBIDDEN_HEADER = re.compile(
    r"cblas|blas|lapack|mkl|dlfcn|socket|spawn|openblas|blis", re.IGNORECASE
)
# A line directive in the kernel would make its following lines look like a header's in the
# preprocessor output, hiding them from the checks that read that output.
_LINE_DIRECTIVE_RE = re.compile(r"^[ \t]*(?:#|%:)[ \t]*(?:line\b|\d)", re.MULTILINE)
# Attributes that place code or data by hand (section, symver: their text goes to the
# assembler verbatim), bind names to other symbols, or run code outside the kernel call.
_FORBIDDEN_ATTRIBUTES = frozenset(
    {"section", "symver", "alias", "weakref", "ifunc", "constructor", "destructor", "naked"}
)


def source_violations(source: str, preprocessed_main: str = "") -> list[str]:
    """Reasons the code breaks the rules as written (before compiling it)."""
    reasons: list[str] = []
    for text in (source, preprocessed_main):
        if not text:
            continue
        reasons += unreadable(text)
        code = blank_comments_and_literals(text)
        for match in _INCLUDE.finditer(code if text is source else ""):
            if _FORBIDDEN_HEADER.search(match.group(1)):
                reasons.append(
                    f"includes <{match.group(1)[:200]}>: numeric libraries are not allowed"
                )
        if text is source and _LINE_DIRECTIVE_RE.search(code):
            reasons.append("uses a #line directive or line marker: not allowed in a kernel")
        for match in _FORBIDDEN_CALL_RE.finditer(code):
            reasons.append(f"calls {match.group(1)}(): not allowed in a kernel")
        if _ASM_RE.search(code):
            reasons.append("uses inline assembly: not allowed (use intrinsics)")
        pragmas = pragma_text(code) + _pragma_operators(text)
        names = {name for _, name, _ in attributes(code)}
        if any(re.match(r"GCC\s+optimize", p) for p in pragmas) or "optimize" in names:
            reasons.append(
                "changes the optimisation level (#pragma GCC optimize / optimize attribute): "
                "the level is an experiment setting"
            )
        for name in sorted(names & _FORBIDDEN_ATTRIBUTES):
            reasons.append(f"uses the {name} attribute: not allowed in a kernel")
        if "?" in names:
            reasons.append("has an attribute list that cannot be read")
    return list(dict.fromkeys(reasons))


# --- library violations: object ------------------------------------------------------------

_ALLOWED_EXACT = frozenset(
    """malloc calloc realloc free aligned_alloc posix_memalign memalign valloc
    memcpy memmove memset memcmp __memcpy_chk __memmove_chk __memset_chk
    __stack_chk_fail __stack_chk_guard _GLOBAL_OFFSET_TABLE_ __tls_get_addr
    printf puts putchar fprintf fputs fputc fflush fwrite stdout stderr __printf_chk
    __fprintf_chk exit _exit _Exit abort __assert_fail
    __cpu_indicator_init __cpu_model __cpu_features2 abs labs llabs""".split()  # noqa: SIM905
)
_LIBM = (
    r"sqrt|cbrt|fabs|fmin|fmax|fma|fdim|floor|ceil|round|lround|llround|trunc|rint|lrint|"
    r"nearbyint|fmod|remainder|copysign|exp|exp2|expm1|log|log2|log10|log1p|pow|hypot|sin|cos|"
    r"tan|asin|acos|atan|atan2|sinh|cosh|tanh|frexp|ldexp|modf|scalbn|ilogb|logb|nan|erf|erfc"
)
_ALLOWED_RE = re.compile(
    r"^((" + _LIBM + r")[fl]?|GOMP_\w+|omp_\w+|__(mul|div|mod|udiv|umod|popcount|clz|ctz|ffs|"
    r"parity|bswap|ashl|ashr|lshr|neg|cmp|ucmp|fix\w*|float\w*|extend\w*|trunc\w*)\w*\d|"
    r"__(sqrt|fabs|fmin|fmax)\w*_finite)$"
)
_FORBIDDEN_SECTIONS = re.compile(
    r"^\.(init_array|fini_array|preinit_array|ctors|dtors|init|fini)"
    r"(\.|$)"
)


def object_violations(
    undefined: Iterable[str],
    defined: Iterable[tuple[str, str]],
    sections: Iterable[str],
    *,
    function: str,
    runtime_symbols: frozenset[str] = frozenset(),
) -> list[str]:
    """Check ``nm -u`` names, ``nm --defined-only`` (type, name) pairs and section names."""
    reasons = []
    for name in sorted(set(undefined)):
        base = name.split("@")[0]
        if base not in _ALLOWED_EXACT and not _ALLOWED_RE.match(base):
            reasons.append(f"uses the symbol {base}, which is not on the allow-list")
    for kind, name in defined:
        if kind in "iI":
            reasons.append(f"defines {name} as an indirect function (runs before main)")
        elif kind.isupper() and name == "main":
            reasons.append(
                "defines main: the harness provides main; answer with the kernel "
                "(and its helpers) only"
            )
        elif (
            kind.isupper()
            and name != function
            and (
                name.startswith("__")
                or name.split("@")[0] in runtime_symbols
                or name.startswith(("hpcrl", "GOMP_", "omp_"))
            )
        ):
            reasons.append(f"defines {name}, a name of the C/OpenMP runtime or the harness")
    for section in sections:
        if _FORBIDDEN_SECTIONS.match(section):
            reasons.append(f"has a {section} section: code that runs outside the kernel call")
    return reasons


def parse_nm(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """``nm`` output to (undefined names, [(type, name) of defined symbols])."""
    undefined, defined = [], []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("U", "w", "v"):
            undefined.append(parts[1])
        elif len(parts) == 3:
            defined.append((parts[1], parts[2]))
    return undefined, defined


def parse_sections(readelf: str) -> list[str]:
    return re.findall(r"^\s*\[\s*\d+\]\s+(\S+)", readelf, re.MULTILINE)


_SYMBOL_ROW = re.compile(r"^\s*\d+:\s")
_SYMBOL = re.compile(
    r"^\s*\d+:\s+[0-9a-fA-F]+\s+(?:0x)?[0-9a-fA-F]+\s+(?P<type>\w+)\s+(?P<bind>\w+)\s+"
    r"(?P<vis>\w+)\s+(?P<ndx>\w+)(?:\s+(?P<name>\S+))?\s*$"
)


def parse_readelf_symbols(readelf: str) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """``readelf -s -W`` output to the same (undefined names, [(type, name)]) as ``parse_nm``,
    plus the rows that could not be read (the caller fails closed on those).

    One readelf call replaces ``nm``, which loads the LTO plugin and costs ~10x more. Types
    follow nm's convention where the checks care: ``i`` for an IFUNC, upper case for a
    global/weak/unique definition, lower case for a local one; file and section symbols
    (which nm hides) are skipped.
    """
    undefined: list[str] = []
    defined: list[tuple[str, str]] = []
    unreadable: list[str] = []
    for line in readelf.splitlines():
        if not _SYMBOL_ROW.match(line):
            continue
        match = _SYMBOL.match(line)
        if match is None:
            unreadable.append(line.strip())
            continue
        name = match.group("name") or ""
        kind, bind = match.group("type"), match.group("bind")
        if match.group("ndx") == "UND":
            if name:
                undefined.append(name)
            continue
        if kind in ("FILE", "SECTION") or not name:
            continue
        if kind == "IFUNC":
            defined.append(("i", name))
        else:
            defined.append(("t" if bind == "LOCAL" else "T", name))
    return undefined, defined, unreadable


@dataclass(frozen=True)
class ObjectListing:
    """The kernel's object as one ``readelf -S -s -W`` listing shows it, read once."""

    readelf: str
    undefined: list[str]
    defined: list[tuple[str, str]]
    unreadable: list[str]  # symbol rows that could not be read: the check fails closed

    @classmethod
    def parse(cls, readelf: str) -> ObjectListing:
        return cls(readelf, *parse_readelf_symbols(readelf))


_SECTION_ROW = re.compile(r"^\s*\[\s*(\d+)\]")
_SECTION = re.compile(
    r"^\s*\[\s*(?P<index>\d+)\]\s+(?P<name>\S+)\s+(?P<type>\S+)\s+[0-9a-fA-F]+\s+[0-9a-fA-F]+"
    r"\s+[0-9a-fA-F]+\s+[0-9a-fA-F]+\s+(?P<flags>[A-Za-z]*)\s+\d+\s+\d+\s+\d+\s*$"
)
_CODE_SECTION = re.compile(r"^\.text(\.[\w.]+)?$")


def layout_violations(readelf: str) -> list[str]:
    """Reasons from ``readelf -S -s -W``: only compiled functions may be executable.

    Bytes placed in an executable section by hand (a data array there) are machine code
    that no source check saw: raw system calls, instructions of a forbidden technique. An
    executable stack (nested-function trampolines) would let the kernel run bytes it writes.
    """
    reasons: list[str] = []
    executable: set[str] = set()
    stack_note = None
    for line in readelf.splitlines():
        if not _SECTION_ROW.match(line) or line.strip().startswith("[Nr]"):
            continue
        match = _SECTION.match(line)
        if match is None:
            if line.strip().startswith("[ 0]"):
                continue  # the null section has no name
            reasons.append(f"has a section header that cannot be read: {line.strip()[:120]}")
            continue
        name, flags = match.group("name"), match.group("flags")
        if name == ".note.GNU-stack":
            stack_note = flags
        elif "X" in flags:
            executable.add(match.group("index"))
            if not _CODE_SECTION.match(name):
                reasons.append(f"has an executable section {name}: code must be compiled C")
            if "W" in flags:
                reasons.append(f"has a section {name} that is both writable and executable")
    if stack_note is None or "X" in stack_note:
        reasons.append(
            "needs an executable stack (a nested function whose address is taken?): not allowed"
        )
    for line in readelf.splitlines():
        match = _SYMBOL.match(line)
        if (
            match
            and match.group("ndx") in executable
            and match.group("type") not in ("FUNC", "SECTION", "FILE", "NOTYPE")
        ):
            reasons.append(
                f"places the data {match.group('name') or '?'} in an executable "
                "section: code must be compiled C"
            )
    return reasons
