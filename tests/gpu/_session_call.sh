set -u
log=$OUT/log.txt
source tests/gpu/lib.sh
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=uuid,name,vbios_version,driver_version,power.limit,clocks.max.sm,clocks.max.mem,temperature.gpu --format=csv | tee -a $log
nvidia-smi -q -d PERFORMANCE,CLOCK,POWER,TEMPERATURE > $OUT/smi_idle.txt 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,clocks_event_reasons.active --format=csv,noheader -lms 100 > $OUT/smi_grid.csv 2>&1 &
smi=$!
run grid 420 bash -c 'python3 -m dbo.bench experts --steps 20 --json $OUT/experts.json 2>&1 | while IFS= read -r l; do echo "$(date +%s.%N) $l"; done'
kill $smi
nvidia-smi -q -d PERFORMANCE,CLOCK,POWER,TEMPERATURE > $OUT/smi_after.txt 2>&1
run clocks 120 python3 tests/gpu/probe_clocks.py --seconds 3
