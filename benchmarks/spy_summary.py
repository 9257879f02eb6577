"""Shares of Engine.train_step on the worker's compute thread in a spy_worker.py profile, by phase."""
import os,sys,collections
path, label = sys.argv[1], sys.argv[2]
# The line of access.py that runs the op itself: samples whose leaf is there are the op's own time
# (its C++ runs under that frame), not the hook's Python overhead. Found, not hard-coded: it moves.
_ACCESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'zeroray', 'fetch', 'access.py')
OP_LINE = next(f':{i})' for i, l in enumerate(open(_ACCESS), 1) if 'return func(*args' in l)
CATS=[('forward (loss_fn)','lm_loss'),('backward (run_backward, incl. grad hooks)','_engine_run_backward'),('grad hooks: GradIntake._grad_ready -> GradBuckets.add_grad','_grad_ready'),
('ParameterAccess.__torch_function__ (cumulative, includes the op it runs)','fetch/access.py'),('  of which Python overhead (leaf in fetch/access.py other than the op line, on_access)','@@'),
('GradBuckets.finish (waiting for the reductions after backward)','GradBuckets.finish'),('GradBuckets._acquire waiting mid-backward','GradBuckets._acquire'),('status all-reduce (Engine._status)','Engine._status'),('optimizer (ShardedOptimizer.step)','ShardedOptimizer.step'),('publish (Engine._publish)','Engine._publish'),('fetch waits (Units.wait)','Units.wait')]
c=collections.Counter(); step=0; cat=collections.Counter()
for l in open(path):
    if '_ComputeThread._loop' not in l: continue
    st,_,n=l.rstrip().rpartition(' '); n=int(n)
    if 'Engine.train_step' not in st: continue
    step+=n; fr=st.split(';'); leaf=fr[-1]
    for name,key in CATS:
        if key=='@@':
            if ('fetch/access.py' in leaf and OP_LINE not in leaf) or 'on_access' in leaf or '_is_metadata' in leaf: cat[name]+=n
        elif key in st: cat[name]+=n
    c[leaf]+=n
print(f'# {label}: train_step samples {step}')
for name,_ in CATS: print(f'{cat[name]/step:6.1%}  {name}')
print('# top leaf frames')
for k,n in c.most_common(8): print(f'{n/step:6.1%}  {k}')
