#!/usr/bin/env python3
"""Static checks of wgmma kernels' machine code (SASS). No GPU needed: CTest runs this on every
machine, with the pinned cuobjdump and nvdisasm that scripts/setup.sh installs.

    check_kernel_sass.py --kernel-regex REGEX [--max-waits N] [--kernels N] --cuobjdump PATH BINARY
    check_kernel_sass.py --self-test

The kernels checked are the functions of BINARY whose (mangled) name matches --kernel-regex:
`decode_kernel` for decode (CTest decode_sass), `prefill_kernel` for prefill (prefill_sass).
--kernels is how many must match (0: none is fine, reported as "no kernels matched"), and
--max-waits the most wgmma waits (WARPGROUP.DEPBAR) one kernel may hold: a kernel's own
figure, from the places its code waits for its wgmma groups.

What each check guards against. Each fault also shows on the GPU, but only under compute-sanitizer
or in a benchmark of the right shape; here every build is checked, on any machine:

1. Warpgroup convergence. wgmma instructions (WARPGROUP.ARRIVE = wgmma.fence, WARPGROUP.DEPBAR
   = wgmma.wait_group, HGMMA / QGMMA = wgmma.mma_async on BF16 / FP8) are `.aligned`: the four
   warps of a warpgroup must execute each of them together. A branch on a warp-uniform vote
   (VOTE.ALL / VOTE.ANY, from __all_sync or __any_sync) may be taken by some warps of a
   warpgroup and not others, so the code it skips must hold none of them. ptxas inserts waits of
   its own: it once put a WARPGROUP.DEPBAR inside the decode BF16 rescale that only warps whose
   row maxima moved execute. The results stayed right; compute-sanitizer synccheck caught it on
   the GPU.
2. No serialised wgmma. When ptxas cannot prove an asynchronous accumulator safe it waits for
   every wgmma (warning C7515, or silently), and the tensor cores run one at a time: a kernel
   then holds a WARPGROUP.DEPBAR per wgmma instead of a handful.
3. No local memory: register spills in these kernels cost far more than they show in a quick
   benchmark of one shape.
"""
import argparse
import re
import subprocess
import sys

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"Function\s*:\s*(\S+)")
RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
RESOURCE_FUNCTION = re.compile(r"Function (\S+):")  # how `cuobjdump -res-usage` names a function


MMA = re.compile(r"\b[HQIB]GMMA\.")  # wgmma.mma_async: BF16/FP16 (H), FP8 (Q), integer, binary


def is_mma(text):
    return MMA.search(text) is not None


def is_warpgroup_instruction(text):
    return text.startswith("WARPGROUP.") or is_mma(text)


def parse_sass(sass):
    """{function name: [(pc, instruction text)]} from `cuobjdump -sass` output."""
    functions, current = {}, None
    for line in sass.splitlines():
        match = FUNCTION.search(line)
        if match:
            current = match.group(1)
            functions[current] = []
            continue
        match = INSTRUCTION.search(line)
        if match and current is not None:
            functions[current].append((int(match.group(1), 16), match.group(2)))
    return functions


def vote_skipped_regions(instructions):
    """(vote pc, first skipped pc, branch target) for each vote followed by a forward branch."""
    regions = []
    for i, (pc, text) in enumerate(instructions[:-1]):
        if not (text.startswith("VOTE.ALL") or text.startswith("VOTE.ANY")):
            continue
        # The branch on the vote's predicate follows within a few instructions.
        for branch_pc, branch in instructions[i + 1:i + 4]:
            target = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", branch)
            if target and int(target.group(1), 16) > branch_pc:
                regions.append((pc, branch_pc, int(target.group(1), 16)))
                break
    return regions


def check_function(name, instructions, max_waits):
    errors = []
    for vote_pc, branch_pc, target in vote_skipped_regions(instructions):
        inside = [(pc, text) for pc, text in instructions if branch_pc < pc < target and is_warpgroup_instruction(text)]
        for pc, text in inside:
            errors.append(f"{name}: {text} at {pc:#x} lies in code that the branch after VOTE at {vote_pc:#x} "
                          f"lets some warps of a warpgroup skip (to {target:#x})")
    waits = sum(1 for _, text in instructions if text.startswith("WARPGROUP.DEPBAR"))
    mmas = sum(1 for _, text in instructions if is_mma(text))
    if mmas == 0:
        errors.append(f"{name}: no wgmma at all (not a kernel this check expects?)")
    if waits > max_waits:
        errors.append(f"{name}: {waits} wgmma waits for {mmas} wgmmas (at most {max_waits} expected): "
                      "ptxas serialised the wgmmas")
    return errors


def check_resources(resource_text, kernel, max_stack=0):
    """Local-memory use above `max_stack` bytes of each kernel matching `kernel` (a compiled
    regex), from `cuobjdump -res-usage`."""
    errors, current, seen = [], None, 0
    for line in resource_text.splitlines():
        match = RESOURCE_FUNCTION.search(line)
        if match:
            current = match.group(1)
            continue
        match = RESOURCES.search(line)
        if match and current and kernel.search(current):
            seen += 1
            stack, local = int(match.group(2)), int(match.group(4))
            if stack > max_stack or local > max_stack:
                errors.append(f"{current}: STACK {stack} and LOCAL {local} bytes (register spills)")
    return errors, seen


def run_checks(cuobjdump, binary, kernel, expected_kernels, max_waits, max_stack=0):
    """(errors, number of kernels checked) for the kernels of `binary` matching `kernel`."""
    sass = subprocess.run([cuobjdump, "-sass", binary], check=True, capture_output=True, text=True).stdout
    resources = subprocess.run([cuobjdump, "-res-usage", binary], check=True, capture_output=True, text=True).stdout
    kernels = {name: ins for name, ins in parse_sass(sass).items() if kernel.search(name)}
    errors = []
    if len(kernels) < expected_kernels:
        errors.append(f"found {len(kernels)} kernels matching {kernel.pattern!r} in {binary}, expected "
                      f"{expected_kernels} (is cuobjdump's nvdisasm next to it?)")
    for name, instructions in sorted(kernels.items()):
        errors += check_function(name, instructions, max_waits)
        print(f"{name}: {len(instructions)} instructions, "
              f"{sum(1 for _, t in instructions if is_mma(t))} wgmma, "
              f"{sum(1 for _, t in instructions if t.startswith('WARPGROUP.DEPBAR'))} wgmma waits, "
              f"{len(vote_skipped_regions(instructions))} vote-guarded regions")
    resource_errors, seen = check_resources(resources, kernel, max_stack)
    errors += resource_errors
    if seen < len(kernels):
        errors.append(f"resource usage found for {seen} of {len(kernels)} kernels")
    return errors, len(kernels)


# Hand-written SASS in cuobjdump's format: a clean kernel, then the two faults this script exists
# for. The self-test proves the checks can fail.
_GOOD = """
        Function : decode_kernel_good
        /*0000*/                   VOTE.ALL P0, P0 ;
        /*0010*/               @P0 BRA 0x40 ;
        /*0020*/                   FMUL R24, R24, R2 ;
        /*0030*/                   FMUL R25, R25, R2 ;
        /*0040*/                   WARPGROUP.ARRIVE ;
        /*0050*/                   HGMMA.64x256x16.F32.BF16 R24, R184, gdesc[UR12].tnspB, R24, gsb0 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0070*/                   EXIT ;
"""
_DIVERGENT_WAIT = _GOOD.replace("decode_kernel_good", "decode_kernel_divergent").replace(
    "/*0030*/                   FMUL R25, R25, R2 ;", "/*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;")
_SERIALISED = "        Function : decode_kernel_serialised\n" + "".join(
    f"        /*{2 * i:04x}*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R152, gdesc[UR16], R152, gsb0 ;\n"
    f"        /*{2 * i + 1:04x}*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n" for i in range(40))


def self_test():
    functions = parse_sass(_GOOD + _DIVERGENT_WAIT + _SERIALISED)
    results = {name: check_function(name, ins, max_waits=12) for name, ins in functions.items()}
    expectations = {
        "decode_kernel_good": lambda e: not e,
        "decode_kernel_divergent": lambda e: len(e) == 1 and "VOTE" in e[0],
        "decode_kernel_serialised": lambda e: len(e) == 1 and "serialised" in e[0],
    }
    failed = [name for name, expect in expectations.items() if name not in results or not expect(results[name])]
    spills = ("Function decode_kernel_spills:\n  REG:168 STACK:8 SHARED:0 LOCAL:8 CONSTANT[0]:984\n"
              "Function prefill_kernel_spills:\n  REG:168 STACK:0 SHARED:0 LOCAL:16 CONSTANT[0]:984\n")
    for pattern in ("decode_kernel", "prefill_kernel"):  # each regex sees its own kernel only
        resource_errors, _ = check_resources(spills, re.compile(pattern))
        if len(resource_errors) != 1 or pattern not in resource_errors[0]:
            failed.append(f"{pattern}_spills")
    for name in failed:
        print(f"self-test: the check of {name} did not report what it should: {results.get(name)}")
    return not failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuobjdump", default="cuobjdump")
    parser.add_argument("--self-test", action="store_true", help="check the checks on hand-written SASS")
    parser.add_argument("--kernel-regex", help="the kernels to check: a regex over their mangled names")
    parser.add_argument("--kernels", type=int, default=1,
                        help="how many kernels must match (0: none is fine, reported as 'no kernels matched')")
    parser.add_argument("--max-waits", type=int, default=12, help="the most wgmma waits one kernel may hold")
    parser.add_argument("--max-stack", type=int, default=0,
                        help="bytes of stack or local memory a kernel may use (0: no spill at all)")
    parser.add_argument("binary", nargs="?", help="the speedmla library or an object file")
    args = parser.parse_args()
    if args.self_test:
        ok = self_test()
        print("self-test passed" if ok else "self-test FAILED")
        return 0 if ok else 1
    if not args.binary or not args.kernel_regex:
        parser.error("--kernel-regex and a library or object file are required")
    kernel = re.compile(args.kernel_regex)
    try:
        errors, checked = run_checks(args.cuobjdump, args.binary, kernel, args.kernels, args.max_waits, args.max_stack)
    except FileNotFoundError:
        print(f"ERROR: no cuobjdump at {args.cuobjdump!r}: scripts/setup.sh installs the pinned one")
        return 1
    for error in errors:
        print("ERROR:", error)
    if not errors and checked == 0:
        print(f"no kernels matched {args.kernel_regex!r}: nothing to check")
        return 0
    print(f"SASS checks of {checked} kernel(s) matching {args.kernel_regex!r} passed" if not errors
          else f"{len(errors)} SASS check(s) failed")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
