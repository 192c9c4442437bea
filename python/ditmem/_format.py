"""Byte and time formatting as the CLI prints them (crates/spec/src/units.rs `fmt_bytes`)."""

from __future__ import annotations

from typing import Optional

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: Optional[int]) -> str:
    """Binary units, 3 significant digits: the CLI's `fmt_bytes`."""
    if n is None:
        return "-"
    neg = n < 0
    n = abs(int(n))
    if n < 1024:
        return f"{'-' if neg else ''}{n} B"
    v = float(n)
    u = 0
    while v >= 1024.0 and u < len(_UNITS) - 1:
        v /= 1024.0
        u += 1
    if v >= 100.0:
        text = f"{v:.0f} {_UNITS[u]}"
    elif v >= 10.0:
        text = f"{v:.1f} {_UNITS[u]}"
    else:
        text = f"{v:.2f} {_UNITS[u]}"
    return ("-" if neg else "") + text


def fmt_secs(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1000:.1f} ms"


def html_escape(text: object) -> str:
    return (
        str(text)
        .replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
    )


def html_table(rows, header=None) -> str:
    out = ['<table style="border-collapse:collapse;font-size:90%">']
    if header:
        out.append(
            "<tr>"
            + "".join(
                f'<th style="text-align:left;padding:2px 8px">{html_escape(h)}</th>' for h in header
            )
            + "</tr>"
        )
    for row in rows:
        out.append(
            "<tr>"
            + "".join(
                f'<td style="text-align:{"right" if i else "left"};padding:2px 8px">'
                f"{html_escape(c)}</td>"
                for i, c in enumerate(row)
            )
            + "</tr>"
        )
    out.append("</table>")
    return "".join(out)


def html_bar(used: Optional[int], capacity: Optional[int], label: str = "device") -> str:
    """A device bar: used against capacity (red when over)."""
    if not used or not capacity:
        return ""
    frac = used / capacity
    width = min(frac, 1.0) * 100.0
    color = "#c0392b" if frac > 1.0 else "#27ae60"
    return (
        '<div style="margin:4px 0;font-size:90%">'
        f"{html_escape(label)}: {html_escape(fmt_bytes(used))} of "
        f"{html_escape(fmt_bytes(capacity))} ({frac * 100:.0f} %)"
        '<div style="width:320px;height:12px;border:1px solid #888;background:#eee">'
        f'<div style="width:{width:.1f}%;height:100%;background:{color}"></div></div></div>'
    )
