# P nodes (server.sh): DP2 TP4 per node, each its own DP group

# <P0_IP> P 主节点

python launch_online_dp.py --dp-size 2 --tp-size 4 --dp-size-local 2 --dp-rank-start 0 --dp-address <P0_IP> --dp-rpc-port 12321 --vllm-start-port 7100

# <P1_IP> P 从节点

python launch_online_dp.py --dp-size 2 --tp-size 4 --dp-size-local 2 --dp-rank-start 0 --dp-address <P1_IP> --dp-rpc-port 12321 --vllm-start-port 7100

# <P2_IP> P 从节点

python launch_online_dp.py --dp-size 2 --tp-size 4 --dp-size-local 2 --dp-rank-start 0 --dp-address <P2_IP> --dp-rpc-port 12321 --vllm-start-port 7100

# <P3_IP> P 从节点

python launch_online_dp.py --dp-size 2 --tp-size 4 --dp-size-local 2 --dp-rank-start 0 --dp-address <P3_IP> --dp-rpc-port 12321 --vllm-start-port 7100

# D nodes (server.sh): DP32 TP1, 8 ranks per node

# <D0_IP> D 主节点

python launch_online_dp.py --dp-size 32 --tp-size 1 --dp-size-local 8 --dp-rank-start 0 --dp-address <D0_IP> --dp-rpc-port 12321 --vllm-start-port 7100

# <D1_IP> D 从节点

python launch_online_dp.py --dp-size 32 --tp-size 1 --dp-size-local 8 --dp-rank-start 8 --dp-address <D1_IP> --dp-rpc-port 12321 --vllm-start-port 7100

# <D2_IP> D 从节点

python launch_online_dp.py --dp-size 32 --tp-size 1 --dp-size-local 8 --dp-rank-start 16 --dp-address <D2_IP> --dp-rpc-port 12321 --vllm-start-port 7100

# <D3_IP> D 从节点

python launch_online_dp.py --dp-size 32 --tp-size 1 --dp-size-local 8 --dp-rank-start 24 --dp-address <D3_IP> --dp-rpc-port 12321 --vllm-start-port 7100
