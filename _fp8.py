import torch
from vaeopt import info as I, stage_table
from vaeopt.families import get_family
from vaeopt.stage_table import DeviceInfo
H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), fp8_compute=(True, ""), triton=(True, ""), graphs=(True, ""), cudnn=(True, ""))
cpu = DeviceInfo.of(torch.device("cpu"))
for inf in (H200, cpu):
    for name, shape in I.WORKLOADS:
        fam = get_family(name)
        rows = I._decisions(fam, shape, torch.bfloat16 if inf.type=="cuda" else torch.float32, inf)
        for s in [x for x in ("fp8", "fp8 convs") if x in rows]:
            print(inf.name, name, s, rows[s][0], str(rows[s][1])[:300])
