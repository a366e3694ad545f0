"""The KDA envelope as a server's own kernels read it: the common tables (``prewarm_kernels.spec.read_kda``) and the
server's own ``[spec.<server>]`` table, with what every server's KDA layer fixes checked once for all of them."""
from __future__ import annotations

from prewarm_kernels.spec import FLA_CALL_OPTIONS, SpecError, read_kda


def read_server_kda(spec: dict, table: str, server: str, backends: tuple, backend_expected: str,
                    always: dict[str, str]) -> tuple[dict, dict]:
    """(``read_kda`` of ``spec`` without ``[spec.<table>]``, that table). A SpecError where the target's backend is
    not one of ``backends`` (``backend_expected`` says which), the spec sets an fla-core call option (``server``'s
    options are under ``[spec.<table>]``, not silently ignored), turns off a switch the server's layer always has on
    (``always``: key -> why), or ``[spec.<table>]`` is not a table."""
    extra = spec.get(table, {})
    read = read_kda({k: v for k, v in spec.items() if k != table})
    if read["backend"] not in backends:
        raise SpecError("backend", read["backend"], backend_expected)
    fla_only = sorted(set(spec.get("serving", {})) & set(FLA_CALL_OPTIONS))
    if fla_only:
        raise SpecError(f"serving.{fla_only[0]}", spec["serving"][fla_only[0]], "absent: an option of fla-core's "
                        f"KDA (prewarm.providers.fla.kda); {server}'s are under [spec.{table}]")
    for key, why in always.items():
        if not read[key]:
            raise SpecError(f"serving.{key}", False, f"true (or absent): {why}")
    if not isinstance(extra, dict):
        raise SpecError(table, extra, "a table")
    return read, extra
