"""Built-in fault injection (`ep-harness selftest`): shows that each check catches the
defects its property should, by planting them one class at a time.

injections.py   the defect classes and their parameters (no torch)
expectations.py which property must catch which injection (each Property's must_catch, explained)
wrap.py         on the ranks: the subject wrapped so that its output carries the defect
matrix.py       the verdict per check x injection and its terminal rendering
run.py          plan, baseline launch, one launch per injection, selftest.json
"""
