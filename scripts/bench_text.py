"""The gateway's text assembly per step as an output grows: ms per step of two tokens,
averaged over the steps up to 100, 1,000, 2,000 and 4,000 tokens of the demo tokenizer.

    python scripts/bench_text.py [gateway/step/text.py]

The argument is the file holding `TextAssembler`, so that another checkout's version can
be timed beside this one. docs/serving-path.md ("Text by window") keeps the figures.
"""
import importlib.util
import sys
import time

from transformers import AutoTokenizer

from specd.config import DEMO_TARGET

path = sys.argv[1] if len(sys.argv) > 1 else "gateway/step/text.py"
spec = importlib.util.spec_from_file_location("text_under_test", path)
assert spec is not None and spec.loader is not None
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
ids = tokenizer.encode(open("gateway/core.py").read() * 3, add_special_tokens=False)[:4000]
assembler = module.TextAssembler(tokenizer, ["\n\n\n\n"])
marks = {}
began = time.perf_counter()
for at in range(0, 4000, 2):
    assembler.add(ids[at:at + 2])
    if at + 2 in (100, 1000, 2000, 4000):
        marks[at + 2] = time.perf_counter()
previous, previous_time, report = 0, began, []
for tokens, when in marks.items():
    report.append(f"up to {tokens}: {(when - previous_time) / ((tokens - previous) / 2) * 1e3:.3f} ms/step")
    previous, previous_time = tokens, when
print(f"{path}: " + "; ".join(report))
