"""Real text for tests and benchmarks: docstrings of the Python standard library.

Whole docstrings are the documents (a few words to well past 256 tokens), their first lines the queries.
The list of modules is fixed and the order deterministic, so every run of a benchmark sees the same text.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from functools import cache

_MODULES = [
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "colorsys",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email.message",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "getopt",
    "glob",
    "graphlib",
    "hashlib",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "locale",
    "logging",
    "mailbox",
    "math",
    "mimetypes",
    "multiprocessing.pool",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "poplib",
    "pprint",
    "queue",
    "random",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unicodedata",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
    "zoneinfo",
]

# Written for these tests: accents, scripts without spaces, right-to-left text, emoji, mixed case.
NON_ASCII_TEXTS = (
    "Ünïcödé characters are normalised before tokenisation.",
    "Le café est très chaud ce matin, prends garde à ne pas te brûler.",
    "Die Straße war nass, und die Bäume rauschten im Wind.",
    "El niño comió paella en la playa de València.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "東京は日本の首都であり、世界最大の都市圏の一つです。",
    "机器学习模型把文本变成向量，用于语义搜索。",
    "검색 증강 생성은 문서를 임베딩으로 찾습니다.",
    "القطة تجلس على السجادة في غرفة المعيشة.",
    "שלום עולם, זהו משפט בעברית.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "यह एक हिंदी वाक्य है जो खोज के लिए उपयोग किया जाता है।",
    "Emoji carry meaning too 🚀🔥👍 — and so do dashes… and “quotes”.",
    "naïve façade coöperate résumé jalapeño",
    "Ça va? Oui, ça va très bien, merci beaucoup!",
    "Zürich, København, Kraków, Škoda, Øresund.",
    "∑ x² ≤ ∞ and √2 ≈ 1.414 ± 0.001",
    "Tiếng Việt có nhiều dấu thanh điệu khác nhau.",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "Ελληνικά, Русский, 中文, العربية, עברית in one line.",
)

ONE_WORD_TEXTS = ("python", "embedding", "a", "Zürich", "42", "retrieval", "東京", "🚀", "search", "x")


@cache
def _docstrings() -> tuple[str, ...]:
    seen: set[str] = set()
    docs: list[str] = []
    for module_name in _MODULES:
        module = importlib.import_module(module_name)
        with warnings.catch_warnings():  # typing's deprecated aliases warn when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            members = [value for _, value in sorted(vars(module).items())]
        for obj in (module, *members):
            doc = inspect.getdoc(obj) if _is_documented(obj, module_name) else None
            if doc and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return tuple(docs)


def _is_documented(obj: object, module_name: str) -> bool:
    if inspect.ismodule(obj):
        return obj.__name__ == module_name
    return (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == module_name


def documents(limit: int | None = None, min_chars: int = 200) -> list[str]:
    """Whole docstrings of at least a paragraph, in a fixed order that mixes lengths."""
    return [doc for doc in _docstrings() if len(doc) >= min_chars][:limit]


def paragraphs(min_chars: int = 40) -> list[str]:
    """The docstrings' paragraphs, each once: a few thousand passages of a sentence or more, for retrieval."""
    found = (paragraph.strip() for doc in _docstrings() for paragraph in doc.split("\n\n"))
    return list(dict.fromkeys(paragraph for paragraph in found if len(paragraph) >= min_chars))


def queries(limit: int | None = None) -> list[str]:
    """First lines of the docstrings: short, query-like text."""
    return [doc.splitlines()[0] for doc in _docstrings()[:limit]]


def parity_texts() -> list[str]:
    """A mixed set for parity tests: documents of every length, queries, non-ASCII and one-word texts."""
    docs = documents(min_chars=0)
    longest = sorted(docs, key=len, reverse=True)[:25]  # well over 256 tokens: exercises truncation
    return [*docs[:150], *longest, *queries(30), *NON_ASCII_TEXTS, *ONE_WORD_TEXTS]
