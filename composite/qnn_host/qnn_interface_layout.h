/* Where things sit in QNN's public ABI, for the few fields composite touches without a QNN header.
 * The one place these numbers are written: htp_abi_shim.c and runner_cpp/qnn_libraries.cpp include
 * this file, and composite/qnn_host reads the #defines below for its build-id probe.
 *
 * QnnInterface_getProviders hands out QnnInterface_t records: backendId, providerName and
 * apiVersion (40 bytes on 64-bit), then the function table. */
#ifndef COMPOSITE_QNN_INTERFACE_LAYOUT_H
#define COMPOSITE_QNN_INTERFACE_LAYOUT_H

#define COMPOSITE_QNN_FUNCTION_TABLE_OFFSET 40
/* Positions in the function table (pointer-sized slots). */
#define COMPOSITE_QNN_BACKEND_GET_BUILD_ID_INDEX 4
#define COMPOSITE_QNN_DEVICE_CREATE_INDEX 40
/* QnnDevice_Config_t's custom HTP payload: at byte 4 in QNN 2.37 (what ExecuTorch 1.5.1 writes),
 * at byte 8 from QNN 2.47 on. */
#define COMPOSITE_QNN_OLD_PAYLOAD_OFFSET 4
#define COMPOSITE_QNN_NEW_PAYLOAD_OFFSET 8

#endif
