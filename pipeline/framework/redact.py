"""Secrets out of everything the project prints, logs, tags or writes: the one masking helper.

A user hands the project credentials in three shapes, and each can reach a console line, a log file, a
traceback, an MLflow tag or param, a `_CONFIG.json` or a lock file's command line:

- in a URI's user info:           http://user:PASSWORD@host/      -> http://user:***@host/
- in a URI's query:               s3://b/p?secret_key=SK           -> s3://b/p?secret_key=***
- as a NAME=value pair:           AWS_SECRET_ACCESS_KEY=SK         -> AWS_SECRET_ACCESS_KEY=***
  (and an `Authorization: Bearer TOKEN` header)

`mask` replaces the secret part and keeps the rest, so a masked line still says which host, user and
variable were meant. `is_secret_name` is the same rule `bertpipe submit` uses to refuse `--env` values.
"""
from __future__ import annotations

import logging
import re
import traceback
from typing import Any

MASK = "***"

# Substrings that make a name secret wherever they appear in one of its words ...
_SECRET_WORDS = ("SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
# ... and whole words that do. A word *ending* in TOKEN or KEY counts too (HF_TOKEN, APIKEY, ACCESSKEY), but
# not one that only starts with it: TOKENIZERS_PARALLELISM is a setting the project itself forwards.
_SECRET_PARTS = {"PASS", "AUTHORIZATION", "SIGNATURE", "SIG", "COOKIE"}

# scheme://user:password@ — the user name stays (it says who), the password goes. A password may hold ':'
# but not '/', '@' or whitespace (those must be percent-encoded in a URI).
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:)(?P<secret>[^\s/@]+)(?P<tail>@)")
# scheme://TOKEN@ — a user info without a password that is long enough to be a token (GitHub's are 40).
_BARE_TOKEN = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<secret>[A-Za-z0-9_.~-]{20,})(?P<tail>@)")
# ?name=value / &name=value in a URI (pyarrow's s3://...?secret_key=, presigned X-Amz-Signature=, SAS sig=).
_QUERY = re.compile(r"(?P<head>[?&;](?P<name>[^=&;\s#]+)=)(?P<secret>[^&;\s#]+)")
# NAME=value on a command line or in an env dump; dotted names too (`--set mlflow.password=x`).
_ASSIGN = re.compile(r"(?P<head>(?<![\w.-])(?P<name>[A-Za-z_][A-Za-z0-9_.]*)=)(?P<secret>[^\s&;'\"]+)")
# An HTTP credential header printed in a log: `Authorization: Basic ...`, `Bearer ...`.
_BEARER = re.compile(r"(?P<head>(?:\bAuthorization:\s*(?:Basic|Bearer|Token)|\bBearer)\s+)"
                     r"(?P<secret>[A-Za-z0-9._~+/=-]{8,})")


def is_secret_name(name: str) -> bool:
    """True for a variable or parameter name that names a secret (AWS_SECRET_ACCESS_KEY, HF_TOKEN, password)."""
    for part in re.split(r"[^A-Za-z0-9]+", name.upper()):
        if not part:
            continue
        if any(word in part for word in _SECRET_WORDS) or part in _SECRET_PARTS:
            return True
        if part.endswith(("TOKEN", "KEY", "KEYS")):
            return True
    return False


def _masked(match: re.Match) -> str:
    return match.group("head") + MASK + (match.groupdict().get("tail") or "")


def _masked_if_secret_name(match: re.Match) -> str:
    return _masked(match) if is_secret_name(match.group("name")) else match.group(0)


def mask(text: str) -> str:
    """`text` with every credential it holds replaced by ***; the same text when it holds none."""
    if not text:
        return text
    text = _USERINFO.sub(_masked, text)
    text = _BARE_TOKEN.sub(_masked, text)
    text = _QUERY.sub(_masked_if_secret_name, text)
    text = _ASSIGN.sub(_masked_if_secret_name, text)
    return _BEARER.sub(_masked, text)


def has_credentials(text: str) -> bool:
    return mask(text) != text


def strip_userinfo(uri: str) -> str:
    """The URI without its user:password@ part (what may be handed on; the credentials must come otherwise)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^\s/@]*@", r"\1", uri)


def mask_data(data: Any) -> Any:
    """A copy of a JSON-like value (dicts, lists, strings) with every string masked: configs logged or written."""
    if isinstance(data, str):
        return mask(data)
    if isinstance(data, dict):
        return {k: (MASK if isinstance(k, str) and is_secret_name(k) and isinstance(v, str) and v else mask_data(v))
                for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(mask_data(v) for v in data)
    return data


def install_log_masking() -> None:
    """Mask every log record of this process when it is created, so no handler (ours, MLflow's, Ray's) and no
    formatter can write a secret: the message and the formatted traceback are masked before any handler sees
    them. Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "bertpipe_masking", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report, not ours
            return record
        masked = mask(message)
        if masked != message:
            record.msg, record.args = masked, ()
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            # Formatters reuse exc_text when it is set: format the traceback once, masked.
            record.exc_text = mask("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        if record.stack_info:
            record.stack_info = mask(record.stack_info)
        return record

    factory.bertpipe_masking = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def install_excepthook() -> None:
    """An uncaught exception's traceback (printed by Python, not by us) is masked too."""
    import sys

    def hook(exc_type, exc, tb) -> None:
        sys.stderr.write(mask("".join(traceback.format_exception(exc_type, exc, tb))))

    sys.excepthook = hook
