"""bench/gemms.py's recording of the GEMMs an op issues, on a stand-in for BlasLt (no GPU needed)."""
from bench.gemms import recording


class StandInLt:
    """BlasLt's protocol as recording() sees it: matmul(...) plans once per key, in self.plans."""

    def __init__(self):
        self.plans = {}

    def matmul(self, transa, transb, m, n, k, A, lda, B, ldb, D, ldc, beta=0.0, epilogue="none", **pointers):
        key = (transa, transb, m, n, k, lda, ldb, ldc, epilogue)
        self.plans.setdefault(key, [f"plan {len(self.plans)}"])


def test_recording_names_each_calls_plan_and_keeps_the_plans_made_before():
    lt = StandInLt()
    lt.matmul("T", "N", 8, 4, 2, None, 2, None, 2, None, 8)
    first = lt.plans[("T", "N", 8, 4, 2, 2, 2, 8, "none")]
    with recording(lt) as calls:
        lt.matmul("T", "N", 8, 4, 2, None, 2, None, 2, None, 8)                   # planned before
        lt.matmul("N", "N", 2, 4, 8, None, 2, None, 8, None, 2, epilogue="bias")  # new
        lt.matmul("N", "N", 2, 4, 8, None, 2, None, 8, None, 2, epilogue="bias")  # again
    assert [key for _, _, key in calls] == [("T", "N", 8, 4, 2, 2, 2, 8, "none"),
                                            ("N", "N", 2, 4, 8, 2, 8, 2, "bias"),
                                            ("N", "N", 2, 4, 8, 2, 8, 2, "bias")]
    assert calls[1][1] == {"epilogue": "bias"}
    assert len(lt.plans) == 2 and lt.plans[("T", "N", 8, 4, 2, 2, 2, 8, "none")] is first
    assert "matmul" not in vars(lt)   # the class's own method again
