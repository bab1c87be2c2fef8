"""The errors both tree cores raise with the same message (made here, raised there)."""

from __future__ import annotations

from typing import Any

__all__ = ["reentered", "stale_match", "lock_host_only", "node_not_copyable",
           "cpu_values_only", "bad_rank", "bad_session", "rank_needs_one_tier"]


def reentered(what: str) -> RuntimeError:
    """The error for a call into a tree core (or its heap) while another call of it runs."""
    return RuntimeError(
        f"RadixCache re-entered from inside one of its own calls ({what} while another call "
        "was running): a token's __index__, an extra_key's __hash__/__eq__, a torch hook, a "
        "finalizer or another thread called into the cache; serialise calls (one thread, or "
        "a lock) and keep cache calls out of such hooks"
    )


def stale_match(why: str) -> ValueError:
    """The error of ``load_back`` for a match whose host continuation is no longer there."""
    return ValueError(f"stale match: {why}; the tree changed since match_prefix made it "
                      "(match again)")


def lock_host_only(node_id: int) -> ValueError:
    """The error of ``inc_lock_ref`` on a node that is only on the host."""
    return ValueError(f"inc_lock_ref on node {node_id}: it is only on the host: load it back "
                      "first (load_back)")


def node_not_copyable() -> TypeError:
    """The error for pickling or copying a node (either core's): only a whole cache can be."""
    return TypeError("a RadixTreeNode cannot be pickled or copied on its own: it is part of "
                     "its cache's tree; pickle or copy the RadixCache instead")


def cpu_values_only(what: str, values: Any) -> TypeError:
    """The error of a pure core of numpy arrays given values that are not a numpy array
    (cache.py hands it CPU values only, as int64 numpy arrays)."""
    return TypeError(f"{what}: a cache with numpy arrays holds CPU values only, given as an "
                     f"int64 numpy array, got {type(values).__name__}")


def bad_rank(what: str, rank: Any) -> Exception:
    """The error for an eviction rank that is not an int in [0, 2^63) (``what`` names where it
    came from): TypeError for a non-int (a bool included), ValueError for one out of range."""
    if type(rank) is not int:
        return TypeError(f"{what} must be an int, got {type(rank).__name__}")
    return ValueError(f"{what} must be in [0, 2**63), got {rank}")


def bad_session(session: Any) -> Exception:
    """The error for a session tag that is not an int in [0, 2^63): TypeError for a non-int
    (a bool included), ValueError for one out of range."""
    if type(session) is not int:
        return TypeError(f"session must be an int, got {type(session).__name__}")
    return ValueError(f"session must be in [0, 2**63), got {session}")


def rank_needs_one_tier() -> ValueError:
    """The error of ``set_rank`` on a core with a host tier (ranks order one tier's leaves)."""
    return ValueError("eviction ranks need a cache without a host tier")
