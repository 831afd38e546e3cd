import time, torch
from pieceworks.backends.attention import triton_extend_kernel as tk
from pieceworks.backends.kv_write import write_rows
dev="cuda"; hq,hkv,d,ps=32,8,128,16
kc=torch.zeros(64,ps,hkv,d,device=dev,dtype=torch.bfloat16); vc=torch.zeros_like(kc)
q=torch.randn(16,hq,d,device=dev,dtype=torch.bfloat16); out=torch.empty_like(q)
table=torch.arange(1,3,dtype=torch.int32,device=dev)[None]; qo=torch.tensor([0,16],dtype=torch.int32,device=dev); lens=torch.tensor([16],dtype=torch.int32,device=dev)
k=torch.randn(16,hkv,d,device=dev,dtype=torch.bfloat16); slots=torch.arange(16,32,device=dev)
for name,fn in [("extend",lambda: tk.extend(q,kc,vc,out,table,qo,lens,1,16,0.088)),
                ("write_rows",lambda: write_rows(kc.view(-1,hkv*d),k.reshape(16,-1),vc.view(-1,hkv*d),k.reshape(16,-1),slots,(1.0,1.0)))]:
    for _ in range(20): fn()
    torch.cuda.synchronize()
    t=time.perf_counter(); n=200
    for _ in range(n): fn()
    h=(time.perf_counter()-t)/n*1e6; torch.cuda.synchronize(); w=(time.perf_counter()-t)/n*1e6
    print(f"{name}: host {h:.1f} us per call, wall {w:.1f}")
