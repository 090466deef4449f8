unset http_proxy
unset https_proxy

python load_balance_proxy_server_example.py \
  --port 18020 \
  --host <D0_IP> \
  --prefiller-hosts \
    <P0_IP> <P0_IP> \
    <P1_IP> <P1_IP> \
    <P2_IP> <P2_IP> \
    <P3_IP> <P3_IP> \
  --prefiller-ports \
    7100 7101 \
    7100 7101 \
    7100 7101 \
    7100 7101 \
  --decoder-hosts \
    <D0_IP> <D0_IP> <D0_IP> <D0_IP> <D0_IP> <D0_IP> <D0_IP> <D0_IP> \
    <D1_IP> <D1_IP> <D1_IP> <D1_IP> <D1_IP> <D1_IP> <D1_IP> <D1_IP> \
    <D2_IP> <D2_IP> <D2_IP> <D2_IP> <D2_IP> <D2_IP> <D2_IP> <D2_IP> \
    <D3_IP> <D3_IP> <D3_IP> <D3_IP> <D3_IP> <D3_IP> <D3_IP> <D3_IP> \
  --decoder-ports \
    7100 7101 7102 7103 7104 7105 7106 7107 \
    7100 7101 7102 7103 7104 7105 7106 7107 \
    7100 7101 7102 7103 7104 7105 7106 7107 \
    7100 7101 7102 7103 7104 7105 7106 7107 \
  >proxy_log.log 2>&1 &
